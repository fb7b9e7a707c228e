"""Tensor-parallel pulls between real processes: decode ranks read head slices of prefill ranks' copies.

Each prefill rank is a process of its own holding vLLM's CPU layout (`[num_blocks, heads, block_size,
2 * head_dim]` per layer) with its share of the heads; the decode ranks (threads here, each its own
consumer and transport) pull what `connectors/vllm/tp.py` plans and must hold exactly their heads'
bytes. Every prefill copy is released well before its hold deadline: read by all its readers, or
declined.
"""

from __future__ import annotations

import threading
import zlib

import pytest
import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.vllm.identity import rank_node_id
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.vllm.tp import TPSplit, plan, rank_key
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
LAYERS, BLOCKS, BLOCK, HEAD_DIM = 2, 16, 4, 8
HOLD_S = 60.0  # the producers' hold deadline: a release that waits for it fails the test
REQUESTS = [("a", 10, [3, 4, 9]), ("b", 4, [7])]  # (request id, tokens, prefill blocks)
DST = {"a": [1, 2, 12], "b": [5]}  # where the decode ranks put them


def head_kv(rid: str, layer: int, head: int, n_blocks: int) -> torch.Tensor:
    """One KV head's bytes of a request in one layer: [n_blocks, block_size, 2 * head_dim]."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{layer}/{head}".encode()))
    return torch.randn(n_blocks, BLOCK, 2 * HEAD_DIM, generator=gen)


def _tensors(per_rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(BLOCKS, per_rank, BLOCK, 2 * HEAD_DIM, device=device) for i in range(LAYERS)}


def _config(kind: ConnectorKind, role: NodeRole, node_id: str, redis_url: str) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=node_id, redis_url=redis_url, kv_deadline_s=HOLD_S)


def prefill_rank(redis_url: str, kind: ConnectorKind, split: TPSplit, rank: int, results, device: str = "cpu") -> None:
    """A prefill rank's process: hold every request's KV of its heads; report when all are released."""
    tensors = _tensors(split.per_rank, device)
    for rid, _, blocks in REQUESTS:
        for layer, t in enumerate(tensors.values()):
            for local in range(split.per_rank):
                t[blocks, local] = head_kv(rid, layer, split.first_head(rank) + local, len(blocks)).to(device)
    config = _config(kind, NodeRole.PREFILL, rank_node_id("prefill", rank, split.tp), redis_url)
    directory = KVDirectory(redis_url)
    epoch = directory.next_epoch(config.node_id)
    producer = KVProducer(config, directory, epoch, create_transport(config, epoch),
                          region_of(tensors, BLOCKS, BLOCK))
    for rid, tokens, blocks in REQUESTS:
        producer.hold(rank_key(rid, rank, split.tp), blocks, tokens)
    results.put(("held", rank))
    results.put(("released", rank, len(peer.wait_released(producer, len(REQUESTS), HOLD_S / 2)) == len(REQUESTS)))
    producer.close()
    directory.close()
    peer.flush_replies()


def _decode_rank(redis_url: str, kind: ConnectorKind, prefill: TPSplit, decode: TPSplit, rank: int,
                 out: dict, errors: dict, device: str = "cpu") -> None:
    """A decode rank's thread: every request's pulls into its own pool (`out[rank]`), or what failed
    (`errors[rank]`), reported by the test's thread rather than raised here."""
    try:
        out[rank] = _pull_all(redis_url, kind, prefill, decode, rank, device)
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        errors[rank] = f"{type(exc).__name__}: {exc}"


def _pull_all(redis_url: str, kind: ConnectorKind, prefill: TPSplit, decode: TPSplit,
              rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    tensors = _tensors(decode.per_rank, device)
    config = _config(kind, NodeRole.DECODE, rank_node_id("decode", rank, decode.tp), redis_url)
    directory = KVDirectory(redis_url)
    consumer = KVConsumer(config, directory, create_transport(config, directory.next_epoch(config.node_id)),
                          region_of(tensors, BLOCKS, BLOCK))
    try:
        for rid, tokens, _ in REQUESTS:
            for pull in plan(prefill, decode, rank):
                key = rank_key(rid, pull.rank, prefill.tp)
                consumer.expect(key, rank_node_id("prefill", pull.rank, prefill.tp))
                consumer.receive_blocks(key, tokens, DST[rid], heads=pull.heads)
        return tensors
    finally:
        consumer.close()
        directory.close()


UCX, TCP, SHM, AUTO = ConnectorKind.UCX, ConnectorKind.TCP, ConnectorKind.SHM, ConnectorKind.AUTO
CASES = [  # (transport, heads, prefill TP, decode TP); over tcp one shape each way (slicing is transport-agnostic)
    # shm: the decode ranks read the prefill ranks' planes themselves (process_vm_readv: cma.py)
    pytest.param(SHM, 4, 1, 1, id="shm-P1-D1"),
    pytest.param(SHM, 4, 1, 2, id="shm-P1-D2"),
    pytest.param(SHM, 4, 2, 1, id="shm-P2-D1"),
    pytest.param(SHM, 1, 2, 1, id="shm-mla-P2-D1"),
    pytest.param(SHM, 2, 4, 2, id="shm-replicated-P4-D2"),
    pytest.param(AUTO, 4, 2, 2, id="auto-P2-D2"),
    pytest.param(UCX, 4, 1, 2, id="ucx-P1-D2"),
    pytest.param(UCX, 4, 2, 1, id="ucx-P2-D1"),
    pytest.param(UCX, 4, 2, 2, id="ucx-P2-D2"),
    pytest.param(UCX, 1, 2, 1, id="ucx-mla-P2-D1"),  # one latent on every rank: rank 1's copy is declined
    pytest.param(UCX, 2, 4, 2, id="ucx-replicated-P4-D2"),
    pytest.param(TCP, 4, 1, 2, id="tcp-P1-D2"),
    pytest.param(TCP, 4, 2, 1, id="tcp-P2-D1"),
]


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")]
# vLLM's per-layer layout on a GPU, both sides' ranks on cuda:0: shm and auto read the peer's tensors by CUDA IPC
GPU_CASES = [pytest.param(k, h, p, d, "cuda", id=f"cuda-{name}", marks=ON_GPU) for k, h, p, d, name in [
    (SHM, 4, 1, 1, "shm-P1-D1"), (SHM, 4, 2, 1, "shm-P2-D1"), (SHM, 1, 2, 1, "shm-mla-P2-D1"),
    (AUTO, 4, 1, 2, "auto-P1-D2"), (UCX, 4, 2, 1, "ucx-P2-D1"), (TCP, 4, 1, 2, "tcp-P1-D2")]]


@pytest.mark.parametrize(("kind", "heads", "p_tp", "d_tp", "device"),
                         [pytest.param(*c.values, "cpu", id=c.id, marks=c.marks) for c in CASES] + GPU_CASES)
def test_decode_ranks_hold_exactly_their_heads(kind, heads, p_tp, d_tp, device, redis_url):
    prefill, decode = TPSplit(heads, p_tp), TPSplit(heads, d_tp)
    results = CTX.Queue()
    procs = [CTX.Process(target=prefill_rank, args=(redis_url, kind, prefill, p, results, device))
             for p in range(p_tp)]
    for proc in procs:
        proc.start()
    try:
        assert sorted(results.get(timeout=60) for _ in procs) == [("held", p) for p in range(p_tp)]
        out: dict[int, dict[str, torch.Tensor]] = {}
        errors: dict[int, str] = {}
        ranks = [threading.Thread(target=_decode_rank, args=(redis_url, kind, prefill, decode, d, out, errors, device))
                 for d in range(d_tp)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(HOLD_S + 10)  # a pull gives up at HOLD_S: a rank still running is stuck
        assert not any(t.is_alive() for t in ranks), "a decode rank outlived its pulls' deadline"
        assert errors == {}, errors
        assert sorted(out) == list(range(d_tp))
        released = sorted(results.get(timeout=HOLD_S) for _ in procs)
        assert released == [("released", p, True) for p in range(p_tp)], "a copy waited for its hold deadline"
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    for d, tensors in out.items():
        for layer, t in enumerate(tensors.values()):
            for rid, _, blocks in REQUESTS:
                for local in range(decode.per_rank):
                    want = head_kv(rid, layer, decode.first_head(d) + local, len(blocks))
                    assert torch.equal(t[DST[rid], local].cpu(), want), f"rank {d} layer {layer} {rid} head {local}"
