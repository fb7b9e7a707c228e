"""A producer process for connector tests: fills its pool, publishes requests, serves pulls.

Any transport: the conformance suite runs the same producer against each. It is a
standalone producer (`open_producer`): no node, engine or router around it.
"""

from __future__ import annotations

import os
import queue
import select
import signal
import time
import zlib
from collections import deque

import torch
import zmq

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.control.sockets import LINGER_MS
from kvwire.connectors.kv_pool import TORCH_DTYPES, KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.standalone import open_producer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wire import DType, KVLayout

HIDDEN = 24


def layout(dtype: DType = DType.FLOAT32, layers: int = 3, block_size: int = 4) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=dtype)


def request_kv(rid: str, lay: KVLayout, n_blocks: int) -> torch.Tensor:
    """Deterministic random KV of one request: [n_blocks, layers, 2, block_size, heads, head_dim]."""
    gen = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    shape = (n_blocks, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return torch.randn(shape, generator=gen).to(TORCH_DTYPES[lay.dtype])


def request_hidden(rid: str, tokens: int, intermediate: bool, width: int = HIDDEN):
    """Deterministic random hidden states of one request: [tokens, width] (and a residual, if intermediate)."""
    gen = torch.Generator().manual_seed(zlib.crc32(rid.encode()) + 1)
    h = torch.randn(tokens, width, generator=gen)
    if intermediate:
        return IntermediateTensors({"hidden_states": h, "residual": (h * 2).to(torch.bfloat16)})
    return h


def received_as_sent(hidden: torch.Tensor, rid: str, tokens: int, width: int = HIDDEN) -> bool:
    """Whether a consumer's hidden states of one request are what a producer of `request_hidden` sent: `[tokens,
    width]` whose last row is the request's (only that row travels: connectors/hidden.py, split_request)."""
    want = request_hidden(rid, tokens, False, width)
    assert isinstance(want, torch.Tensor)
    return tuple(hidden.shape) == tuple(want.shape) and torch.equal(hidden[-1].cpu(), want[-1])


def config(kind: ConnectorKind, role: NodeRole, node_id: str, redis_url: str, deadline_s: float) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=node_id, redis_url=redis_url, kv_deadline_s=deadline_s)


def pool_of(kv_caches: list[torch.Tensor]) -> KVPool:
    """The block-major pool behind a side's per-layer views (`side.kv_caches`), sharing their memory."""
    region = KVRegion.from_kv_caches(kv_caches)
    (plane,), lay = region.planes, region.layout
    n = plane.shape[0]
    shape = (n, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return KVPool(lay, n, plane.view(TORCH_DTYPES[lay.dtype]).view(shape))


def _die_on_first_send(producer: KVProducer) -> None:
    """Make this process SIGKILL itself right after any of its transports starts the first pull (shared memory,
    where the consumer reads by itself: when the first read is claimed, before it is confirmed; reads with no
    claim are turned off, as they need no live producer: tests/connectors/transports/shm/test_direct.py)."""
    import kvwire.connectors.transports.tcp.send_engine as tcp_engine
    from kvwire.connectors.transports.shm.send_engine import SHMSendEngine

    tcp_engine.TURN_BUDGET_BYTES = 1  # TCP's start() then writes one batch (what the socket takes), not the lot
    producer._board = None  # test-only reach: no hold words, so every shared-memory read claims

    def then_die(step):
        def wrapped(*args, **kwargs):
            step(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        return wrapped

    for server in producer._servers.values():  # test-only reach into the servers
        if isinstance(server._engine, SHMSendEngine):
            server.claim = then_die(server.claim)
        else:
            server._engine.start = then_die(server._engine.start)


def produce(redis_url: str, kind: ConnectorKind, lay: KVLayout, requests: list[tuple[str, int, list[int]]],
            intermediate: bool, deadline_s: float, results, num_blocks: int = 64, die_mid_transfer: bool = False,
            device: str = "cpu", node_id: str = "producer-test", consumer_endpoint: str = "",
            hidden_width: int = HIDDEN) -> None:
    """Publish each (request_id, num_tokens, src_blocks), telling `consumer_endpoint` directly when one is
    given; report {request_id: released block ids} once all are released."""
    side = open_producer(config(kind, NodeRole.PREFILL, node_id, redis_url, deadline_s), layout=lay,
                         num_blocks=num_blocks, device=device)
    pool = pool_of(side.kv_caches)
    if die_mid_transfer:
        _die_on_first_send(side.producer)
    for rid, tokens, blocks in requests:
        pool.data[blocks] = request_kv(rid, lay, len(blocks)).to(device)
        hidden = request_hidden(rid, tokens, intermediate, hidden_width)
        hidden = hidden.to(device) if isinstance(hidden, torch.Tensor) else \
            IntermediateTensors({k: v.to(device) for k, v in hidden.items()})
        seq = SequenceInput(rid, [0] * tokens, 0, blocks, consumer_endpoint=consumer_endpoint)
        side.connector.send_kv_caches_and_hidden_states(None, ModelInput([seq]), side.kv_caches, hidden)
    results.put(("published", len(requests)))
    results.put(("released", wait_released(side.producer, len(requests), deadline_s * 3 + 10)))
    side.close()
    flush_replies()


def flush_replies() -> None:
    """End a producer process as a server would end: the replies still queued on its closed sockets go out
    (for up to their linger) before it exits. A child that exits at once (multiprocessing's `os._exit`)
    drops them, and a consumer waiting for its last ok times out (seen with declined TP copies)."""
    zmq.Context.instance().destroy(linger=LINGER_MS)


def wait_released(producer: KVProducer, want: int, timeout_s: float) -> dict[str, list[int]]:
    """{request_id: block ids} of the first `want` requests the producer releases, as a node loop takes them
    (woken by its fd); fewer if `timeout_s` passes first."""
    releases, released = Releases(producer), {}
    deadline = time.monotonic() + timeout_s
    while len(released) < want:
        try:
            rid, blocks = releases.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        released[rid] = blocks
    return released


class Releases:
    """A producer's releases, taken as a node loop takes them (`released()` once its fd is readable), read with a
    queue's `get` and `empty`."""

    def __init__(self, producer: KVProducer):
        self._producer = producer
        self._got: deque[tuple[str, list[int]]] = deque()

    def get(self, timeout: float) -> tuple[str, list[int]]:
        """The next `(request_id, block_ids)`. Raises queue.Empty if none comes within `timeout`."""
        deadline = time.monotonic() + timeout
        while not self._take():
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            select.select([self._producer.wakeup.fd], [], [], left)
        return self._got.popleft()

    def empty(self) -> bool:
        return not self._take()

    def _take(self) -> int:
        self._producer.wakeup.drain()
        self._got.extend((r.request_id, list(r.block_ids)) for r in self._producer.released())
        return len(self._got)
