"""vLLM's per-layer KV tensors as kvwire planes (connectors/vllm/layout.py): no vLLM needed, only its shapes."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.wire import PoolLayout

NB, BS, HEADS, HD, LAYERS = 6, 4, 2, 8, 3
SHAPES = {
    PoolLayout.VLLM_CPU: (NB, HEADS, BS, 2 * HD),
    PoolLayout.VLLM: (2, NB, BS, HEADS, HD),
    PoolLayout.VLLM_BLOCK_FIRST: (NB, 2, BS, HEADS, HD),
}


def _caches(pool: PoolLayout, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(SHAPES[pool], generator=gen).to(torch.bfloat16)
            for i in range(LAYERS)}


def _block(pool: PoolLayout, kv: torch.Tensor, block: int) -> torch.Tensor:
    """One block of one layer's tensor, every K and V value in it."""
    return kv[:, block] if pool == PoolLayout.VLLM else kv[block]


@pytest.mark.parametrize("pool", list(SHAPES), ids=str)
def test_region_describes_the_layout(pool):
    region = region_of(_caches(pool, 0), NB, BS)
    assert region.layout.pool == pool
    assert (region.layout.num_layers, region.layout.num_kv_heads, region.layout.head_dim) == (LAYERS, HEADS, HD)
    assert region.layout.block_size == BS and region.num_blocks == NB
    assert region.block_nbytes == LAYERS * 2 * BS * HEADS * HD * 2  # bf16


@pytest.mark.parametrize("pool", list(SHAPES), ids=str)
def test_copying_the_pieces_moves_exactly_those_blocks(pool):
    """Copy src blocks [1, 2, 5] into dst blocks [4, 0, 3] piece by piece, as transports do: those blocks of
    every layer equal the source's, and every other block of the destination is untouched."""
    src_caches, dst_caches = _caches(pool, 1), _caches(pool, 2)
    before = {k: v.clone() for k, v in dst_caches.items()}
    src, dst = region_of(src_caches, NB, BS), region_of(dst_caches, NB, BS)
    src_blocks, dst_blocks = [1, 2, 5], [4, 0, 3]
    plan = plan_runs(src_blocks, dst_blocks)
    for s, d in zip(src.pieces([(s, n) for s, _, n in plan]), dst.pieces([(d, n) for _, d, n in plan])):
        d.copy_(s)
    for name in src_caches:
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(_block(pool, dst_caches[name], d), _block(pool, src_caches[name], s))
        for b in set(range(NB)) - set(dst_blocks):
            assert torch.equal(_block(pool, dst_caches[name], b), _block(pool, before[name], b))


@pytest.mark.parametrize("pool", list(SHAPES), ids=str)
def test_layer_parts_hold_one_layer(pool):
    caches = _caches(pool, 3)
    region = region_of(caches, NB, BS)
    runs = [(2, 2)]
    for layer, kv in enumerate(caches.values()):
        got = b"".join(bytes(p) for p in region.layer_parts(runs, layer))
        want = torch.cat([_block(pool, kv, b).reshape(-1) for b in (2, 3)])
        if pool == PoolLayout.VLLM:  # the K plane's run, then the V plane's
            want = torch.cat([kv[0, 2:4].reshape(-1), kv[1, 2:4].reshape(-1)])
        assert got == want.view(torch.uint8).numpy().tobytes()


def test_unknown_or_mixed_layouts_are_refused():
    with pytest.raises(ValueError, match="does not know"):
        region_of({"a": torch.zeros(NB, BS, 7)}, NB, BS)
    with pytest.raises(ValueError, match="alike"):
        region_of({"a": torch.zeros(SHAPES[PoolLayout.VLLM_CPU]), "b": torch.zeros(SHAPES[PoolLayout.VLLM])}, NB, BS)
    with pytest.raises(ValueError, match="contiguous"):
        region_of({"a": torch.zeros(NB, BS, HEADS, 2 * HD).transpose(1, 2)}, NB, BS)
    with pytest.raises(ValueError, match="no KV caches"):
        region_of({}, NB, BS)


def test_region_is_the_same_memory():
    caches = _caches(PoolLayout.VLLM_CPU, 4)
    region: KVRegion = region_of(caches, NB, BS)
    region.planes[0][1].fill_(0)
    assert not torch.any(next(iter(caches.values()))[1].view(torch.uint8))
