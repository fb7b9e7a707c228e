"""connectors/transports/block_copy.py: blocks moved by one gather/scatter per plane land as a copy per piece does."""

from __future__ import annotations

import random

import pytest
import torch

from kvwire.connectors.transports.block_copy import (
    batched_pays,
    copy_blocks,
    gather_parts,
    plane_groups,
    scatter_parts,
)
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.transports.tcp.stream import ByteStream, Staging
from kvwire.connectors.transports.ucx.packing import PACK_BYTES, Message, gather, scatter
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.wire import PoolLayout

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 3, 2, 8, 4, 24


class _Backend:
    """What region_of asks of vLLM's attention backend class: its name, and whether it is MLA."""

    def __init__(self, name: str, mla: bool):
        self._name, self._mla = name, mla

    def get_name(self) -> str:
        return self._name

    def is_mla(self) -> bool:
        return self._mla


def _region(pool: PoolLayout, device: str = "cpu", seed: int = 0) -> KVRegion:
    """A small pool of random bytes in `pool`'s layout."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(torch.float16).to(device)

    if pool == PoolLayout.KVWIRE:
        base = rand(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM)
        return KVRegion.from_kv_caches([base[:, layer] for layer in range(LAYERS)])
    shape = {PoolLayout.VLLM: (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM),
             PoolLayout.VLLM_CPU: (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
             PoolLayout.VLLM_HNC: (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
             PoolLayout.VLLM_MLA: (NUM_BLOCKS, 1, BLOCK_SIZE, 4 * HEAD_DIM),
             PoolLayout.VLLM_BLOCK_FIRST: (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM)}[pool]
    backend = {PoolLayout.VLLM_HNC: _Backend("FLASH_ATTN", False), PoolLayout.VLLM_MLA: _Backend("TRITON_MLA", True)}
    region = region_of({f"layer.{i}": rand(*shape) for i in range(LAYERS)}, NUM_BLOCKS, BLOCK_SIZE,
                       backend=backend.get(pool))  # type: ignore[arg-type]
    assert region.layout.pool == pool
    return region


def _blocks(contiguous: bool, side: int, n: int = 10) -> list[int]:
    return list(range(3 + side, 3 + side + n)) if contiguous else random.Random(side).sample(range(NUM_BLOCKS), n)


@pytest.mark.parametrize("pool", list(PoolLayout))
@pytest.mark.parametrize("contiguous", [False, True])
def test_a_gather_scatter_lands_every_byte_as_a_copy_per_piece_does(pool, contiguous):
    src = _region(pool, seed=1)
    batched, per_piece = _region(pool, seed=2), _region(pool, seed=2)
    src_ids, dst_ids = _blocks(contiguous, 0), _blocks(contiguous, 1)
    runs = plan_runs(src_ids, dst_ids)
    copy_blocks(batched.planes, src.planes, runs, batched=True)
    copy_blocks(per_piece.planes, src.planes, runs, batched=False)
    for got, want, s in zip(batched.planes, per_piece.planes, src.planes):
        assert torch.equal(got, want)
        assert torch.equal(got[dst_ids], s[src_ids])


def test_a_vllm_layers_k_and_v_planes_move_together_and_layers_in_one_allocation_as_one():
    per_layer = _region(PoolLayout.VLLM)
    groups = plane_groups(per_layer.planes, per_layer.planes)
    assert [tuple(d.shape[:2]) for d, _ in groups] == [(2, NUM_BLOCKS)] * LAYERS
    one = torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.float16)
    together = region_of({f"layer.{i}": one[i] for i in range(LAYERS)}, NUM_BLOCKS, BLOCK_SIZE)
    groups = plane_groups(together.planes, together.planes)
    assert len(groups) == 1 and groups[0][0].shape[:2] == (2 * LAYERS, NUM_BLOCKS)
    assert groups[0][0].dtype == torch.int64  # rows of 128 bytes move as 8-byte words
    mixed = plane_groups(together.planes, per_layer.planes)  # only what stacks on both sides stacks
    assert [d.shape[0] for d, _ in mixed] == [2] * LAYERS


def test_odd_rows_fall_back_to_narrower_words_and_still_land():
    src = torch.randint(0, 255, (2, 12, 6), dtype=torch.uint8)
    dst = torch.zeros(2, 12, 6, dtype=torch.uint8)
    runs = plan_runs([1, 5, 6, 9], [0, 2, 3, 11])
    copy_blocks(list(dst), list(src), runs, batched=True)
    assert torch.equal(dst[:, [0, 2, 3, 11]], src[:, [1, 5, 6, 9]])
    assert plane_groups(list(dst), list(src))[0][0].dtype == torch.int16


def test_the_host_batches_only_many_small_pieces():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    scattered = [(i, 2 * i, 1) for i in range(128)]
    assert not batched_pays(cpu, scattered, 2 << 20)  # kvwire's 2 MiB blocks: a copy_ per run is faster
    assert batched_pays(cpu, scattered, 4 << 10, num_planes=4)  # vLLM's small pieces: the gather wins
    assert not batched_pays(cpu, scattered[:2], 4 << 10, num_planes=2)  # too few to pay for the gather
    assert batched_pays(cuda, scattered[:2], 2 << 20) and not batched_pays(cuda, [(0, 0, 8)], 2 << 20)


def test_flat_parts_gather_and_scatter_in_order():
    data = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    sizes = [0, 7, 300, 1, 692]
    parts = list(torch.split(data, sizes))
    buf = torch.zeros(1200, dtype=torch.uint8)
    gather_parts(parts, buf)
    assert torch.equal(buf[:1000], data) and not buf[1000:].any()
    out = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    scatter_parts(buf, out)
    assert torch.equal(torch.cat(out), data)


def test_ucx_packs_of_tensor_pieces_are_gathered_and_scattered_whole():
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (3, 700, 1)]
    dst = [torch.zeros_like(p) for p in src]
    slot = memoryview(bytearray(PACK_BYTES))
    assert gather(src, Message(0, 3, 704, True), slot).nbytes == 704
    scatter(slot, dst, Message(0, 3, 704, True))
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


class _HostStaging(Staging):
    """Unpinned staging, so tensor parts go through the staging path on a host without a GPU."""

    def get(self) -> tuple[torch.Tensor, memoryview]:
        if self._buf is None:
            self._buf = torch.zeros(self.nbytes, dtype=torch.uint8)
            self._view = self._buf.numpy().data
        assert self._view is not None
        return self._buf, self._view


def test_tcp_staging_holds_many_small_tensor_parts_per_chunk():
    data = torch.randint(0, 255, (5000,), dtype=torch.uint8)
    sizes = [100] * 30 + [1500] + [0, 50] * 10  # small parts, one larger than a chunk, empty ones
    src, dst = list(torch.split(data, sizes)), [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    out, into = ByteStream(list(src), True, _HostStaging(1024)), ByteStream(list(dst), False, _HostStaging(700))
    chunks = 0
    while not out.done:
        sent = b"".join(bytes(b) for b in out.batch())
        out.advance(len(sent))
        chunks += 1
        while sent:
            view = into.batch()[0]
            n = min(len(view), len(sent))
            view[:n] = sent[:n]
            into.advance(n)
            sent = sent[n:]
    assert into.done and torch.equal(torch.cat(dst), data)
    assert chunks < 12  # 10 parts of 100 per 1024-byte chunk, not one chunk per part


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counting kernel launches needs a CUDA device")
@pytest.mark.parametrize("pool", [PoolLayout.KVWIRE, PoolLayout.VLLM])
def test_cuda_launches_do_not_grow_with_the_number_of_pieces(pool):
    from torch.profiler import ProfilerActivity, profile

    src, dst = _region(pool, "cuda", seed=1), _region(pool, "cuda", seed=2)

    def launches(n: int) -> int:
        runs = plan_runs(list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2)))  # n runs of one block
        copy_blocks(dst.planes, src.planes, runs)  # warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            copy_blocks(dst.planes, src.planes, runs)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")

    few, many = launches(2), launches(NUM_BLOCKS // 2)
    assert many == few, f"{few} launches for 2 runs, {many} for {NUM_BLOCKS // 2}"
