"""`Groups.of` reads vLLM's own KV cache config (connectors/vllm/groups.py): what it takes and what it refuses."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvwire.connectors.vllm.groups import Groups

F32 = torch.float32


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def full(block_size: int = 32) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=F32)


def sliding(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=F32, sliding_window=window)


def test_sliding_window_and_full_groups_are_taken_with_their_windows():
    groups = Groups.of(config(sliding(128), sliding(128), full()))
    assert groups == Groups((128, 128, 0), 32, (("layer.0",), ("layer.1",), ("layer.2",)))
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=F32)
    assert Groups.of(config(mla)).windows == (0,)


def mamba(block_size: int = 32, **kw) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((4, 64), (2, 32, 32)), dtypes=(F32, F32), **kw)


def test_mamba_state_moves_one_block_the_one_after_all_but_the_last_token():
    groups = Groups.of(config(mamba(), full()))
    assert (groups.states, groups.backoff, groups.block_size) == ((32, 0), 1, 32)
    # 70 tokens: attention blocks 0..2; the state after them sits in block 2 (vLLM's "align" mode nulls the rest)
    assert groups.held(([0, 0, 5], [1, 2, 3]), 70) == [5, 1, 2, 3]
    blocks, pick = groups.pull(([0, 0, 9], [4, 6, 8]), 70, first_block=1)  # block 0 in the prefix cache
    assert (blocks, pick) == ([9, 4, 6, 8], [0, 2, 3])  # the state always, attention from block 1 on
    with pytest.raises(ValueError, match="no block to take the state"):
        groups.pull(([0, 0, 0], [4, 6, 8]), 70, first_block=0)


def test_mamba_state_of_one_block_per_request_is_its_first():
    groups = Groups.of(config(mamba(2048), full()))  # prefix caching off: one state block of max_model_len
    assert (groups.block_size, groups.state_block(0, 70), groups.state_block(1, 70)) == (32, 0, None)
    assert groups.held(([7], [1, 2, 3]), 70) == [7, 1, 2, 3]


def test_what_is_not_moved_is_refused_by_name():
    with pytest.raises(ValueError, match="speculative state blocks"):
        Groups.of(config(mamba(num_speculative_blocks=2), full()))
    with pytest.raises(ValueError, match="state only"):
        Groups.of(config(mamba(), mamba()))
    with pytest.raises(ValueError, match="tensor-parallel size 1 only"):
        Groups.of(config(mamba(), full())).check_ranks(2)
    Groups.of(config(full())).check_ranks(2)


def test_a_state_layer_shares_the_attention_pages():
    groups = Groups.of(config(mamba(), full()))
    pool = torch.zeros(8 * 1024, dtype=torch.uint8)  # 8 pages of 1 KiB
    attention = pool.view(F32).view(8, 2, 32, 4)  # [blocks, heads, tokens, K and V]: a page each
    state = pool.view(8, 1024)[:, :900]  # conv and SSM state, padded to the page
    assert list(groups.planes({"layer.0": state, "layer.1": attention})) == ["layer.1"]
    elsewhere = torch.zeros(8 * 1024, dtype=torch.uint8).view(8, 1024)
    with pytest.raises(ValueError, match="layer.0's KV tensor is not the one"):
        groups.planes({"layer.0": elsewhere, "layer.1": attention})


def test_groups_of_unlike_block_sizes_are_refused():
    with pytest.raises(ValueError, match="one block size"):
        Groups.of(config(full(16), full(32)))
