"""A node's start-up transport self-test: a small loopback transfer through the transport it serves.

The node's own transport instance cannot loop back to itself (a shared-memory producer
allocates its pool once, for the node), so the test builds a second instance of the same
kind and config, under the node id `<node>.self-test`, and drives both halves in this
process:

1. `producer_pool` places a small source pool where the transport serves from (a memfd
   for shm and auto), filled with a known pattern; the consumer's pool is an ordinary one.
2. Each send engine the transport serves over (auto: shm and ucx) gets its own transfer
   server, and a held request of scattered blocks (one run large enough to go zero-copy,
   one small enough to travel packed over UCX).
3. The transport's puller pulls it, as a consumer would, within SELF_TEST_DEADLINE_S; the
   bytes are compared, and the transport says what carried them (`data_path`: over UCX,
   the transports UCX selected, e.g. "sysv/cma" or "tcp").
4. Everything is closed; one `TransportCheck` per send engine is returned (never raises:
   a failure is a failed check, with its reason).

Host memory only: a CUDA pool's path (CUDA IPC, UCX's cuda transports) is not exercised.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import ExitStack

import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind
from kvwire.connectors.factory import create_transport
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.producer.held import HeldRequest, HeldTable
from kvwire.connectors.producer.transfer_server import TransferServer
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.transport import Puller, Transport
from kvwire.connectors.wire import DType, KVLayout, KVLocation, TransportCheck, TransportOffer

log = logging.getLogger(__name__)

SELF_TEST_DEADLINE_S = 10.0  # per transport; a working one takes milliseconds
# One block is 64 KiB: the first run (4 blocks, 256 KiB) goes zero-copy over UCX, the last block packed.
LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, block_size=32, dtype=DType.FLOAT32)
SRC_BLOCKS, DST_BLOCKS = [0, 1, 2, 3, 5], [4, 5, 6, 7, 1]
NUM_BLOCKS = 8


def run_self_test(config: ConnectorConfig, epoch: int) -> list[TransportCheck]:
    """Loop a small transfer through each transport `config.kind` serves over (see the module docstring).

    Args:
        config: the node's transfer-plane settings (the test runs as `<node_id>.self-test`).
        epoch: the node's epoch (names what the test's transport shares, e.g. its memfd).
    Returns:
        One check per transport, preferred first; a failed one carries the reason.
    """
    cfg = dataclasses.replace(config, node_id=f"{config.node_id}.self-test", pull_lanes=1)
    start = time.monotonic()
    try:
        with ExitStack() as stack:
            return _run(cfg, epoch, stack)
    except Exception as exc:  # noqa: BLE001 - any failure is the test's result, never the node's crash
        log.error("node %s: transport self-test (%s) failed: %s", config.node_id, config.kind, exc)
        return [TransportCheck(transport=config.kind, ok=False, path="unknown", ms=_ms_since(start),
                               reason=f"{type(exc).__name__}: {exc}")]


def _run(cfg: ConnectorConfig, epoch: int, stack: ExitStack) -> list[TransportCheck]:
    transport = create_transport(cfg, epoch)
    stack.callback(transport.close)
    src = transport.producer_pool(LAYOUT, NUM_BLOCKS, "cpu")
    src.data.copy_(torch.arange(src.data.numel(), dtype=torch.float32).view_as(src.data))
    src_region = KVRegion.from_kv_caches(src.kv_caches)
    dst = KVPool.allocate(LAYOUT, NUM_BLOCKS, "cpu")
    puller = transport.puller(KVRegion.from_kv_caches(dst.kv_caches))
    stack.callback(puller.close)
    addresses = transport.published_addresses(puller)
    held = HeldTable(lambda rid, blocks: None)
    checks = []
    for kind, engine in transport.send_engines(src_region).items():
        server = TransferServer(cfg.host, src_region, held, engine, SELF_TEST_DEADLINE_S,
                                functools.partial(_trusted, addresses.get(kind)), advertise_host=cfg.advertised_host)
        stack.callback(server.close)
        server.start()
        checks.append(_check(cfg, epoch, transport, puller, held, kind, server, src, dst))
    return checks


def _check(cfg: ConnectorConfig, epoch: int, transport: Transport, puller: Puller, held: HeldTable,
           kind: ConnectorKind, server: TransferServer, src: KVPool, dst: KVPool) -> TransportCheck:
    """One loopback pull over `kind`'s server; compares the bytes and names the path."""
    start = time.monotonic()
    deadline = start + SELF_TEST_DEADLINE_S
    offer = TransportOffer(kind, server.side_channel, server.transport_address)
    loc = KVLocation(request_id=f"self-test-{kind}", producer=cfg.node_id, producer_epoch=epoch, kind=kind,
                     side_channel=offer.side_channel, transport_address=offer.transport_address, layout=LAYOUT,
                     block_ids=SRC_BLOCKS, num_tokens=len(SRC_BLOCKS) * LAYOUT.block_size, hidden=[],
                     offers=[offer], host=host_identity())
    dst.data.zero_()
    held.add(HeldRequest(loc, [], deadline))
    try:
        nbytes = puller.pull(loc, DST_BLOCKS, [], deadline)
        path = transport.data_path(puller, loc)
    except Exception as exc:  # noqa: BLE001 - TransferError and the transports' own errors alike
        log.error("node %s: transport self-test over %s failed: %s", cfg.node_id, kind, exc)
        return TransportCheck(transport=kind, ok=False, path="unknown", ms=_ms_since(start), reason=str(exc))
    ms = _ms_since(start)
    if not torch.equal(dst.data[DST_BLOCKS], src.data[SRC_BLOCKS]):
        reason = f"the {nbytes} bytes pulled differ from those sent"
        log.error("node %s: transport self-test over %s failed: %s", cfg.node_id, kind, reason)
        return TransportCheck(transport=kind, ok=False, path=path.label, ms=ms, reason=reason)
    log.info("node %s: transport self-test over %s: %d bytes in %.1f ms over %s", cfg.node_id, kind, nbytes, ms,
             path)
    return TransportCheck(transport=kind, ok=True, path=path.label, ms=ms, reason=path.unknown_reason)


def _trusted(address: bytes | None, consumer: str) -> bytes | None:
    """The transport address the test's one consumer publishes (it is the only one asking)."""
    return address


def _ms_since(start: float) -> float:
    return round((time.monotonic() - start) * 1e3, 2)
