import pytest
import torch

from connectors.kv_region import KVRegion, plan_runs
from connectors.wire import DType, KVLayout
from engine.kv_cache import KVPool


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


def test_per_layer_pools_give_one_plane_per_layer():
    caches = [torch.zeros(8, 2, 4, 2, 4) for _ in range(3)]
    region = KVRegion.from_kv_caches(caches)
    assert len(region.planes) == 3
    assert len(region.pieces([(0, 2), (6, 1)])) == 6
