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


def test_mamba_state_is_refused_by_name():
    mamba = MambaSpec(block_size=32, shapes=((4, 64), (2, 32, 32)), dtypes=(F32, F32))
    with pytest.raises(ValueError, match="MambaSpec.*Mamba and linear"):
        Groups.of(config(mamba, full()))


def test_groups_of_unlike_block_sizes_are_refused():
    with pytest.raises(ValueError, match="one block size"):
        Groups.of(config(full(16), full(32)))
