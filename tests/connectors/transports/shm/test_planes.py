"""Shared memory over planes kvwire did not allocate: vLLM's per-layer KV cache read from the producer's process.

A prefill process holds vLLM-layout tensors (`region_of`) and serves them over `shm` (or `auto`); the
consumer reads the planes straight from that process: on the host with process_vm_readv (cma.py), on a
GPU through the tensors' CUDA IPC handles (cuda_ipc.py; the `cuda` cases, marked gpu). Covered here: the
bytes and the path, a producer killed mid-pull (a typed failure, the consumer lives on), a producer
restarted under a new epoch (its planes opened anew, an old location refused), and `auto` where the
kernel refuses the read (UCX instead, counted). Head slices over shm: test_head_slices.py.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import zlib

import msgspec
import numpy as np
import pytest
import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.shm import cma
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.wire import HeadSlice, PlaneDesc, PoolLayout, ShmAccess, ShmSegment
from kvwire.observability.metrics import Metrics
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
HEADS, BLOCK, HEAD_DIM = 2, 16, 64


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs CUDA")])]
PATHS = {"cpu": "cma", "cuda": "cuda_ipc"}


def _tensors(layers: int, blocks: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """vLLM's LBHNC layout: per layer [blocks, kv_heads, block_size, 2 * head_dim]."""
    return {f"layer.{i}": torch.zeros(blocks, HEADS, BLOCK, 2 * HEAD_DIM, device=device) for i in range(layers)}


def _kv(rid: str, layer: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{layer}".encode()))
    return torch.randn(n, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)


def _config(kind: ConnectorKind, role: NodeRole, node_id: str, redis_url: str, hold_s: float) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=node_id, redis_url=redis_url, kv_deadline_s=hold_s)


def hold_vllm_kv(redis_url: str, kind: ConnectorKind, layers: int, blocks: int, requests: list[tuple[str, list[int]]],
                 hold_s: float, results, device: str = "cpu") -> None:
    """Child: a prefill engine's vLLM-layout KV, each request held for a consumer; reports its epoch, then the
    requests released."""
    tensors = _tensors(layers, blocks, device)
    for rid, ids in requests:
        for layer, t in enumerate(tensors.values()):
            t[ids] = _kv(rid, layer, len(ids)).to(device)
    config = _config(kind, NodeRole.PREFILL, "prefill", redis_url, hold_s)
    directory = KVDirectory(redis_url)
    epoch = directory.next_epoch(config.node_id)
    producer = KVProducer(config, directory, epoch, create_transport(config, epoch), region_of(tensors, blocks, BLOCK))
    for rid, ids in requests:
        producer.hold(rid, ids, len(ids) * BLOCK)
    results.put(("held", epoch))
    results.put(("released", sorted(peer.wait_released(producer, len(requests), hold_s + 5))))
    producer.close()
    directory.close()
    peer.flush_replies()


class Consumer:
    """The test's decode side: vLLM-layout tensors and a consumer over them."""

    def __init__(self, redis_url: str, kind: ConnectorKind, layers: int, blocks: int, hold_s: float = 10.0,
                 device: str = "cpu"):
        self.tensors = _tensors(layers, blocks, device)
        self.metrics = Metrics()
        config = _config(kind, NodeRole.DECODE, "decode", redis_url, hold_s)
        self.directory = KVDirectory(redis_url)
        self.transport = create_transport(config, self.directory.next_epoch(config.node_id))
        self.consumer = KVConsumer(config, self.directory, self.transport, region_of(self.tensors, blocks, BLOCK),
                                   metrics=self.metrics)

    def pull(self, rid: str, dst: list[int]):
        self.consumer.expect(rid, "prefill")
        return self.consumer.receive_blocks(rid, len(dst) * BLOCK, dst)

    def holds(self, rid: str, dst: list[int]) -> bool:
        layers = enumerate(self.tensors.values())
        return all(torch.equal(t[dst].cpu(), _kv(rid, layer, len(dst))) for layer, t in layers)

    def close(self) -> None:
        self.consumer.close()
        self.directory.close()


def _start(redis_url: str, kind: ConnectorKind, layers: int, blocks: int, requests, hold_s: float = 10.0,
           device: str = "cpu"):
    results = CTX.Queue()
    proc = CTX.Process(target=hold_vllm_kv, args=(redis_url, kind, layers, blocks, requests, hold_s, results, device))
    proc.start()
    state, epoch = results.get(timeout=60)
    assert state == "held"
    return proc, results, epoch


@pytest.mark.parametrize("device", DEVICES)
def test_consumer_reads_a_vllm_producers_planes_from_its_process(redis_url, device):
    requests = [("a", [3, 1, 7]), ("b", [0])]
    proc, results, _ = _start(redis_url, ConnectorKind.SHM, 3, 8, requests, device=device)
    side = Consumer(redis_url, ConnectorKind.SHM, 3, 8, device=device)
    try:
        got = side.pull("a", [5, 6, 2])
        assert side.holds("a", [5, 6, 2])
        assert got.kv_bytes == 3 * 3 * HEADS * BLOCK * 2 * HEAD_DIM * 4  # blocks x layers x a layer's block
        entry = side.directory.get("b")
        assert entry is not None and entry.location is not None
        side.pull("b", [4])
        assert side.holds("b", [4])
        assert str(side.transport.data_path(side.consumer._puller, entry.location)) == PATHS[device]
        assert results.get(timeout=30) == ("released", ["a", "b"])
    finally:
        side.close()
        proc.join(10)
        proc.kill()


def test_a_dead_process_is_a_plain_error_not_a_signal():
    proc = CTX.Process(target=os.getpid)
    proc.start()
    proc.join(30)
    segment = ShmSegment(producer="gone", epoch=1, num_blocks=4, block_nbytes=64, access=ShmAccess.CMA,
                         planes=[PlaneDesc(0, 4096, 64)])
    with pytest.raises(cma.CmaError) as caught:
        cma.CmaReader(proc.pid, segment).probe()
    assert caught.value.errno == errno.ESRCH and not caught.value.refused


def test_pieces_merge_runs_and_slice_heads():
    src = torch.arange(4 * 2 * 32, dtype=torch.int32).view(torch.uint8).view(2, 4, 128)  # 2 planes, 4 blocks
    dst = torch.zeros(2, 6, 128, dtype=torch.uint8)
    region = KVRegion((dst[0], dst[1]), peer.layout())
    base = np.array([src[0].data_ptr(), src[1].data_ptr()], dtype=np.uint64)
    stride = np.array([128, 128], dtype=np.uint64)
    local, remote = cma._pieces(region, 0, base, stride, 128, [(0, 2, 2), (3, 0, 1)])
    assert remote[:, 1].tolist() == [256, 128, 256, 128]  # a run of two blocks is one piece, per plane
    assert remote[:, 0].tolist() == [src[0, 0].data_ptr(), src[0, 3].data_ptr(),
                                     src[1, 0].data_ptr(), src[1, 3].data_ptr()]
    assert local[:, 0].tolist() == [dst[0, 2].data_ptr(), dst[0, 0].data_ptr(),
                                    dst[1, 2].data_ptr(), dst[1, 0].data_ptr()]
    local, remote = cma._pieces(region, 32, base + np.uint64(64), stride, 32, [(0, 2, 2)])
    assert remote[:, 1].tolist() == [32] * 4  # a head slice: each block's columns, never merged
    assert remote[:, 0].tolist() == [src[p, b].data_ptr() + 64 for p in (0, 1) for b in (0, 1)]
    assert local[:, 0].tolist() == [dst[p, b].data_ptr() + 32 for p in (0, 1) for b in (2, 3)]


BIG_LAYERS, BIG_BLOCKS = 32, 512  # 512 blocks of 32 layers x 16 KiB: a 256 MiB pull (30-60 ms here) to kill into


def consume_big(redis_url: str, conn, device: str = "cpu") -> None:
    """Child: pull the big request, say "pulling" as it starts; then the error's type (or "ok")."""
    side = Consumer(redis_url, ConnectorKind.SHM, BIG_LAYERS, BIG_BLOCKS, hold_s=2.0, device=device)
    side.consumer.expect("big", "prefill")
    conn.send("pulling")
    try:
        side.consumer.receive_blocks("big", BIG_BLOCKS * BLOCK, list(range(BIG_BLOCKS)))
        conn.send("ok")
    except TransferError as exc:
        conn.send(type(exc).__name__)
    side.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kill_after_s", [0.0, 0.01, 0.03], ids=["0ms", "10ms", "30ms"])
def test_consumer_outlives_a_producer_killed_mid_read(redis_url, kill_after_s, device):
    proc, _, _ = _start(redis_url, ConnectorKind.SHM, BIG_LAYERS, BIG_BLOCKS, [("big", list(range(BIG_BLOCKS)))],
                        device=device)
    parent, child = CTX.Pipe()
    consumer = CTX.Process(target=consume_big, args=(redis_url, child, device))
    try:
        consumer.start()
        assert parent.poll(60) and parent.recv() == "pulling"
        parent.poll(kill_after_s)
        os.kill(proc.pid, signal.SIGKILL)
        consumer.join(30)
        assert consumer.exitcode == 0, f"the consumer died with its producer (exit {consumer.exitcode})"
        outcome = parent.recv()
        assert outcome in {"ok", "ReceiveError", "TransferError"}  # a read that ended first stands
        print(f"killed {kill_after_s * 1e3:.0f} ms into the pull: {outcome}")
    finally:
        for p in (proc, consumer):
            p.join(5)
            p.kill()


@pytest.mark.parametrize("device", DEVICES)
def test_a_restarted_producer_is_opened_anew_and_its_old_epoch_refused(redis_url, device):
    side = Consumer(redis_url, ConnectorKind.SHM, 2, 8, device=device)
    try:
        first, _, epoch1 = _start(redis_url, ConnectorKind.SHM, 2, 8, [("one", [1]), ("stale", [2])], device=device)
        side.pull("one", [3])
        assert side.holds("one", [3])
        stale = side.directory.get("stale")
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        second, results, epoch2 = _start(redis_url, ConnectorKind.SHM, 2, 8, [("two", [1])], device=device)
        assert epoch2 > epoch1
        side.pull("two", [3])  # the same blocks there, other bytes: read from the new process
        assert side.holds("two", [3])
        assert results.get(timeout=30) == ("released", ["two"])
        assert stale is not None and stale.location is not None
        with pytest.raises(TransferError):  # its socket is gone with it: nothing of the old planes is read
            side.consumer._puller.pull(stale.location, [5], [], deadline=_soon())
        second.join(10)
    finally:
        side.close()


def _soon() -> float:
    return time.monotonic() + 5


def _refuse_cma(monkeypatch) -> None:
    def refuse(self) -> None:
        raise cma.CmaError(errno.EPERM, "process_vm_readv: Operation not permitted")

    monkeypatch.setattr(cma.CmaReader, "probe", refuse)


def _cuda_refuses(monkeypatch) -> None:
    """CUDA will not open the producer's handle here (its GPU not visible to this process, no peer access)."""
    from kvwire.connectors.transports.shm import puller

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: invalid device context")

    monkeypatch.setattr(puller, "open_peer", refuse)


@pytest.mark.parametrize(("refuse", "reason"), [(_refuse_cma, "cma_refused"), (_cuda_refuses, "cuda_ipc_refused")],
                         ids=["cma-refused", "cuda-ipc-refused"])
def test_auto_pulls_over_ucx_where_shared_memory_cannot_reach_and_counts_it(redis_url, monkeypatch, refuse, reason):
    refuse(monkeypatch)
    proc, results, _ = _start(redis_url, ConnectorKind.AUTO, 2, 8, [("a", [1, 2]), ("b", [4])])
    side = Consumer(redis_url, ConnectorKind.AUTO, 2, 8)
    try:
        got = side.pull("a", [6, 7])
        assert side.holds("a", [6, 7]) and got.transport == ConnectorKind.UCX and got.fallback == reason
        got = side.pull("b", [0])
        assert side.holds("b", [0]) and got.transport == ConnectorKind.UCX
        assert side.metrics.transport_fallbacks.labels(reason)._value.get() == 2
        assert results.get(timeout=30) == ("released", ["a", "b"])
    finally:
        side.close()
        proc.join(10)
        proc.kill()


@pytest.mark.parametrize("kind", [ConnectorKind.SHM, ConnectorKind.AUTO])
def test_a_gpu_pool_pulling_without_the_copy_kernel_counts_each_pull(redis_url, monkeypatch, kind):
    """Triton missing or broken in a decode process on a GPU: its pulls copy plane by plane, each counted
    (`no_copy_kernel`). Here the CPU pool stands in for the GPU's: the check is told the kernel is missing."""
    from kvwire.connectors.consumer import role

    monkeypatch.setattr(role.row_copy, "missing_on", lambda device: True)
    proc, results, _ = _start(redis_url, kind, 2, 8, [("a", [1, 2]), ("b", [4])])
    side = Consumer(redis_url, kind, 2, 8)
    try:
        assert side.pull("a", [6, 7]).fallback == "no_copy_kernel" and side.holds("a", [6, 7])
        assert side.pull("b", [0]).fallback == "no_copy_kernel" and side.holds("b", [0])
        assert side.metrics.transport_fallbacks.labels("no_copy_kernel")._value.get() == 2
        assert results.get(timeout=30) == ("released", ["a", "b"])
    finally:
        side.close()
        proc.join(10)
        proc.kill()


def test_a_cuda_plane_outside_its_storage_is_refused(monkeypatch):
    """The consumer bounds every plane a producer describes by the allocation its handle opens (no CUDA needed:
    the handle is not opened for real)."""
    from kvwire.connectors.transports.shm import cuda_ipc
    from kvwire.connectors.wire import CudaIpcHandle

    monkeypatch.setattr(cuda_ipc, "_open", lambda ipc: torch.UntypedStorage(0))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    handle = CudaIpcHandle(0, b"", 1024, 0, b"", 0, b"", False)
    msg = ShmSegment(producer="p", epoch=1, num_blocks=4, block_nbytes=256, access=ShmAccess.CUDA_IPC,
                     planes=[PlaneDesc(0, 256, 256)], storages=[handle])  # rows 1..4 of 256 bytes: past 1024
    with pytest.raises(ValueError, match="outside a storage of 1024"):
        cuda_ipc.open_planes(msg)
    with pytest.raises(ValueError, match="plane in storage 1 of 1"):
        cuda_ipc.open_planes(msgspec.structs.replace(msg, planes=[PlaneDesc(1, 0, 256)]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_pick_of_blocks_moves_only_those(redis_url, device):
    """What a sliding-window group or a state page pulls (connectors/vllm/groups.py): some positions of the
    prompt's block list, read where they lie on both sides, the rest untouched."""
    proc, results, _ = _start(redis_url, ConnectorKind.SHM, 2, 8, [("w", [1, 2, 3, 4])], device=device)
    side = Consumer(redis_url, ConnectorKind.SHM, 2, 8, device=device)
    try:
        side.consumer.expect("w", "prefill")
        side.consumer.receive_blocks("w", 4 * BLOCK, [0, 5, 6, 7], pick=[2, 3])
        for layer, t in enumerate(side.tensors.values()):
            assert torch.equal(t[[6, 7]].cpu(), _kv("w", layer, 4)[2:]), layer
            assert not t[[0, 5]].any(), "a block outside the pick was written"
        assert results.get(timeout=30) == ("released", ["w"])
    finally:
        side.close()
        proc.join(10)
        proc.kill()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_cma_copy_split_over_lanes_lands_every_byte(lanes):
    """CmaReader.copy over the copier's lanes (each a share of the pieces, by bytes), read here from this very
    process: the same bytes whatever the split, head slices included."""
    from kvwire.connectors.transports.shm.copier import BlockCopier

    layout = msgspec.structs.replace(peer.layout(), num_kv_heads=4, pool=PoolLayout.VLLM_CPU)  # 4 heads of 64 bytes
    src = [torch.randint(0, 255, (8, 256), dtype=torch.uint8) for _ in range(3)]
    segment = ShmSegment(producer="self", epoch=1, num_blocks=8, block_nbytes=3 * 256, access=ShmAccess.CMA,
                         planes=[PlaneDesc(0, p.data_ptr(), 256) for p in src])
    reader, copier = cma.CmaReader(os.getpid(), segment), BlockCopier(lanes, min_parallel_bytes=0)
    try:
        dst = [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(3)]
        runs = [(0, 4, 2), (5, 0, 3), (7, 7, 1)]
        assert reader.copy(KVRegion(tuple(dst), layout), layout, None, runs, copier) == 6 * 3 * 256
        for s, d in zip(src, dst):
            assert torch.equal(d[[4, 5, 0, 1, 2, 7]], s[[0, 1, 5, 6, 7, 7]])
            assert not d[[3, 6]].any()
        half = [torch.zeros(8, 128, dtype=torch.uint8) for _ in range(3)]  # a rank of 2 heads: heads 2, 3 of ours
        narrow = msgspec.structs.replace(layout, num_kv_heads=2)
        reader.copy(KVRegion(tuple(half), narrow), layout, HeadSlice(2, 0, 2), [(1, 6, 2)], copier)
        for s, d in zip(src, half):
            assert torch.equal(d[[6, 7]], s[[1, 2], 128:])
    finally:
        copier.close()


def test_a_producer_in_another_pid_namespace_is_refused_not_failed():
    """SO_PEERCRED reports pid 0 for a peer whose PID namespace this process cannot see: that is a refusal (auto
    then pulls over UCX), not a read of pid 0."""
    segment = ShmSegment(producer="far", epoch=1, num_blocks=4, block_nbytes=64, access=ShmAccess.CMA,
                         planes=[PlaneDesc(0, 4096, 64)])
    with pytest.raises(cma.CmaError) as caught:
        cma.CmaReader(0, segment).probe()
    assert caught.value.refused


def test_cuda_export_names_each_allocation_once_and_places_every_plane(monkeypatch):
    """The IPC-handle exchange's message, built from CPU stand-ins (the handle itself needs CUDA): vLLM's layers
    in one allocation give one handle and a plane per layer at its offset; a second allocation a second handle."""
    from kvwire.connectors.transports.shm import cuda_ipc
    from kvwire.connectors.wire import CudaIpcHandle

    monkeypatch.setattr(cuda_ipc, "_handle", lambda s: CudaIpcHandle(0, b"h", s.nbytes(), 0, b"", 0, b"", False))
    buffer = torch.zeros(3, 8, HEADS, BLOCK, 2 * HEAD_DIM)  # one allocation, three layers
    other = torch.zeros(8, HEADS, BLOCK, 2 * HEAD_DIM)  # a fourth layer allocated apart
    region = region_of({"l0": buffer[0], "l1": buffer[1], "l2": buffer[2], "l3": other}, 8, BLOCK)
    msg, fds = cuda_ipc.CudaPlanes("p", 3, region).export()
    row = HEADS * BLOCK * 2 * HEAD_DIM * 4
    assert fds == [] and msg.access == ShmAccess.CUDA_IPC and msg.block_nbytes == 4 * row
    assert [s.size_bytes for s in msg.storages] == [buffer.nbytes, other.nbytes]
    assert msg.planes == [PlaneDesc(0, 0, row), PlaneDesc(0, 8 * row, row), PlaneDesc(0, 16 * row, row),
                          PlaneDesc(1, 0, row)]
