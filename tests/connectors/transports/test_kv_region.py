import msgspec
import pytest
import torch

from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.wire import DType, KVLayout, PoolLayout


def test_plan_runs_merges_only_where_both_sides_are_consecutive():
    assert plan_runs([1, 2, 3, 7, 8, 0], [4, 5, 9, 10, 11, 2]) == [(1, 4, 2), (3, 9, 1), (7, 10, 2), (0, 2, 1)]
    assert plan_runs(list(range(10)), list(range(20, 30))) == [(0, 20, 10)]
    assert plan_runs([], []) == []
    with pytest.raises(ValueError):
        plan_runs([1], [1, 2])


def test_block_major_pool_is_one_plane_and_pieces_cover_blocks():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=DType.BFLOAT16)
    pool = KVPool.allocate(layout, 8)
    region = KVRegion.from_kv_caches(pool.kv_caches)
    assert len(region.planes) == 1 and region.block_nbytes == pool.block_nbytes
    pool.data[5].fill_(3.0)
    pieces = region.pieces([(5, 2)])
    assert len(pieces) == 1 and pieces[0].numel() == 2 * pool.block_nbytes
    assert pieces[0].data_ptr() == pool.data[5].data_ptr()  # a view, not a copy


def test_vllm_per_layer_pool_gives_a_k_and_a_v_plane_per_layer():
    caches = [torch.zeros(2, 8, 4, 2, 4, dtype=torch.bfloat16) for _ in range(3)]  # [2, blocks, bs, heads, dim]
    region = KVRegion.from_kv_caches(caches)
    assert len(region.planes) == 6 and region.layout.pool == PoolLayout.VLLM
    assert region.layout == KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=DType.BFLOAT16,
                                      pool=PoolLayout.VLLM)
    pieces = region.pieces([(0, 2), (6, 1)])
    assert len(pieces) == 12
    caches[1][1, 6].fill_(1.0)  # layer 1's V of block 6
    assert pieces[3 * 2 + 1].view(torch.bfloat16).eq(1.0).all()  # plane 3 = layer 1 V, second run
    assert sum(p.view(torch.bfloat16).sum().item() for p in pieces) == 4 * 2 * 4


def test_kvwire_pool_layout_is_reported_and_differs_from_vllm():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=DType.FLOAT32)
    region = KVRegion.from_kv_caches(KVPool.allocate(layout, 4).kv_caches)
    assert region.layout == layout and region.layout.pool == PoolLayout.KVWIRE
    assert region.layout != KVLayout(**{**msgspec.structs.asdict(layout), "pool": PoolLayout.VLLM})


def test_other_tensor_shapes_are_refused():
    with pytest.raises(ValueError, match="neither"):
        KVRegion.from_kv_caches([torch.zeros(8, 2, 4, 2, 4)])  # per-layer but not vLLM's [2, blocks, ...]
