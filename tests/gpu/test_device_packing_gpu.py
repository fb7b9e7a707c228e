"""vLLM's per-layer KV cache on a GPU over UCX and TCP: device-packed UCX, TCP through pinned chunks.

A vLLM-layout pool (`[blocks, kv_heads, block_tokens, 2 * head_dim]` per layer, bf16: 64 KiB a block's
row per layer, 32 KiB for half its heads) lives on cuda:0 in a producer process and in this one; its
requests move between the two, bytes verified, as whole blocks and as a head slice. UCX gathers the small
pieces into device slots and scatters them there (connectors/transports/ucx/packing.py); TCP stages them
through pinned host memory in chunks (connectors/transports/tcp/stream.py). The CPU tests of the same code
are tests/connectors/transports/ucx/test_device_packing.py and test_tcp.py.
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.wire import HeadSlice
from tests import procs
from tests.connectors import peer

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")
CTX = procs.CTX
LAYERS, HEADS, BLOCKS, BLOCK, HEAD_DIM = 4, 8, 96, 16, 128
HOLD_S = 30.0
# (request id, tokens, prefill blocks): scattered single blocks, and a run of 20 consecutive on both sides
# (1.25 MiB a plane: a piece that goes zero-copy, between packs)
REQUESTS = [("a", 40 * BLOCK, [*range(50, 70), *range(3, 41, 2)] + [90]), ("b", 3 * BLOCK - 5, [2, 1, 88])]
DST = {"a": [*range(10, 30), *range(31, 51)], "b": [95, 0, 60]}


def _kv(rid: str, layer: int, n_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """A request's KV in one layer, every head: [n_blocks, HEADS, BLOCK, 2 * HEAD_DIM] of `dtype` (bf16, or uint8:
    an fp8 cache's bytes, as vLLM keeps them), on the CPU."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{layer}".encode()))
    shape = (n_blocks, HEADS, BLOCK, 2 * HEAD_DIM)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.randn(shape, generator=gen).to(dtype)


def _tensors(heads: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(BLOCKS, heads, BLOCK, 2 * HEAD_DIM, dtype=dtype, device="cuda:0")
            for i in range(LAYERS)}


def _config(kind: ConnectorKind, role: NodeRole, node_id: str, redis_url: str) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=node_id, redis_url=redis_url, kv_deadline_s=HOLD_S)


def prefill(redis_url: str, kind: ConnectorKind, dtype: torch.dtype, results) -> None:
    """The producer's process: hold every request's KV on cuda:0; report once all are released."""
    tensors = _tensors(HEADS, dtype)
    for rid, _, blocks in REQUESTS:
        for layer, t in enumerate(tensors.values()):
            t[blocks] = _kv(rid, layer, len(blocks), dtype).to(t.device)
    config = _config(kind, NodeRole.PREFILL, "prefill-gpu", redis_url)
    directory = KVDirectory(redis_url)
    epoch = directory.next_epoch(config.node_id)
    producer = KVProducer(config, directory, epoch, create_transport(config, epoch),
                          region_of(tensors, BLOCKS, BLOCK))
    for rid, tokens, blocks in REQUESTS:
        producer.hold(rid, blocks, tokens)  # synchronizes the device first
    results.put("held")
    results.put(len(peer.wait_released(producer, len(REQUESTS), HOLD_S)))
    producer.close()
    directory.close()
    peer.flush_replies()


def _pull(redis_url: str, kind: ConnectorKind, heads: HeadSlice | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = _tensors(HEADS if heads is None else heads.num_heads, dtype)
    config = _config(kind, NodeRole.DECODE, "decode-gpu", redis_url)
    directory = KVDirectory(redis_url)
    consumer = KVConsumer(config, directory, create_transport(config, directory.next_epoch(config.node_id)),
                          region_of(tensors, BLOCKS, BLOCK))
    try:
        for rid, tokens, _ in REQUESTS:
            consumer.expect(rid, "prefill-gpu")
            consumer.receive_blocks(rid, tokens, DST[rid], heads=heads)
        return tensors
    finally:
        consumer.close()
        directory.close()


SLICE = HeadSlice(4, 0, 4)


@needs_gpu
@pytest.mark.parametrize(("kind", "heads", "dtype"), [
    *((kind, heads, torch.bfloat16) for kind in (ConnectorKind.UCX, ConnectorKind.TCP) for heads in (None, SLICE)),
    (ConnectorKind.UCX, None, torch.uint8), (ConnectorKind.TCP, SLICE, torch.uint8),  # an fp8 cache's bytes
], ids=lambda v: {None: "whole-blocks", SLICE: "head-slice"}.get(v, str(v)) if not isinstance(v, torch.dtype)
    else str(v).removeprefix("torch."))
def test_vllm_layout_kv_moves_between_two_processes_on_one_gpu(kind, heads, dtype, redis_url):
    results = CTX.Queue()
    proc = CTX.Process(target=prefill, args=(redis_url, kind, dtype, results))
    proc.start()
    try:
        assert results.get(timeout=60) == "held"
        tensors = _pull(redis_url, kind, heads, dtype)
        assert results.get(timeout=HOLD_S) == len(REQUESTS)  # released on the consumer's reads
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        proc.kill()
    first, count = (0, HEADS) if heads is None else (heads.src_head, heads.num_heads)
    for layer, t in enumerate(tensors.values()):
        for rid, _, blocks in REQUESTS:
            want = _kv(rid, layer, len(blocks), dtype)[:, first:first + count]
            assert torch.equal(t[DST[rid]].cpu(), want), f"{kind} layer {layer} request {rid}"


@needs_gpu
def test_device_pieces_are_packed_in_device_slots_and_land_byte_exact():
    """In one process, two UCX workers: 32 KiB device pieces go in device-sized packs gathered and scattered on
    the device (slots on cuda:0 on both sides), a 3 MiB piece between them zero-copy, every byte checked."""
    from kvwire.connectors.transports.ucx.flows import SendFlow
    from kvwire.connectors.transports.ucx.lanes import ReceiveLanes
    from kvwire.connectors.transports.ucx.packing import DEVICE_PACK_BELOW, SendStaging
    from kvwire.connectors.transports.ucx.worker import Role, UCXWorker

    device = torch.device("cuda:0")
    sizes = [*[32 << 10] * 600, 3 << 20, *[64 << 10] * 100, 11]
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in sizes]
    dst = [torch.zeros_like(t) for t in src]
    torch.cuda.synchronize(device)
    producer, consumer = UCXWorker(Role.PRODUCER, device_pool=True), ReceiveLanes(1, device)
    try:  # two CUDA pools on one host: endpoints unguarded, as the puller and send engine make them (worker.py)
        consumer.post(producer.address, list(dst), 4, DEVICE_PACK_BELOW, guarded=False)
        staging = SendStaging().for_pull(list(src), DEVICE_PACK_BELOW)
        sends = SendFlow(producer, consumer.address, list(src), 4, DEVICE_PACK_BELOW, staging, guarded=False)
        deadline = time.monotonic() + 30
        while not (consumer.done() and sends.done()):
            assert time.monotonic() < deadline, "transfer did not complete"
            consumer.progress()
            producer.progress()
            sends.advance()
        consumer.check_errors()
        sends.check_errors()
        assert all(torch.equal(s, d) for s, d in zip(src, dst))
        slot = staging.take()
        assert isinstance(slot, torch.Tensor) and slot.device == device
    finally:
        consumer.close()
        producer.close()
