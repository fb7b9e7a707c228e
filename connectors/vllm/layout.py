"""vLLM's per-layer KV tensors seen as kvwire planes, without copying them.

vLLM hands the connector one tensor per attention layer (`register_kv_caches`). Each
layout keeps a block's bytes for one layer in one or two contiguous rows:

- CPU attention: `[num_blocks, kv_heads, block_size, 2 * head_dim]` (K and V side by side
  in the last dimension): one plane per layer (`PoolLayout.VLLM_CPU`);
- FlashAttention and most GPU backends: `[2, num_blocks, block_size, kv_heads, head_dim]`:
  a K and a V plane per layer (`PoolLayout.VLLM`);
- FlashInfer and others: `[num_blocks, 2, block_size, kv_heads, head_dim]`: one plane per
  layer (`PoolLayout.VLLM_BLOCK_FIRST`).

Both sides of a transfer must use the same layout (`KVLayout` compares equal), else the
consumer refuses the pull and vLLM recomputes.
"""

from __future__ import annotations

import torch

from kvwire.connectors.hidden import dtype_of
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.wire import KVLayout, PoolLayout


def region_of(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int) -> KVRegion:
    """The planes behind vLLM's per-layer KV tensors (layer order: as vLLM registers them).

    Args:
        kv_caches: layer name -> that layer's KV tensor.
        num_blocks, block_size: the pool's, from vLLM's KV cache config.
    Raises:
        ValueError: an empty dict, tensors that differ in shape or dtype, a tensor that is not
            contiguous, or a layout kvwire does not know (the message gives the shape).
    """
    if not kv_caches:
        raise ValueError("vLLM registered no KV caches")
    tensors = list(kv_caches.values())
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tensors):
        raise ValueError(f"kvwire needs every layer's KV tensor alike; got {sorted({tuple(t.shape) for t in tensors})}")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"kvwire moves contiguous KV tensors only; layer tensors have shape {tuple(first.shape)} "
                         f"and strides {first.stride()}")
    pool, heads, head_dim, two_planes = _classify(first, num_blocks, block_size)
    planes: list[torch.Tensor] = []  # each [num_blocks, plane_block_nbytes] uint8
    for t in tensors:
        halves = (t[0], t[1]) if two_planes else (t,)
        planes += [h.reshape(num_blocks, -1).view(torch.uint8) for h in halves]
    layout = KVLayout(num_layers=len(tensors), num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
                      dtype=dtype_of(first), pool=pool)
    return KVRegion(tuple(planes), layout)


def _classify(t: torch.Tensor, num_blocks: int, block_size: int) -> tuple[PoolLayout, int, int, bool]:
    """`(pool, kv_heads, head_dim, two planes per layer)` of one layer's tensor."""
    shape = tuple(t.shape)
    if len(shape) == 4 and shape[0] == num_blocks and shape[2] == block_size and shape[3] % 2 == 0:
        return PoolLayout.VLLM_CPU, shape[1], shape[3] // 2, False
    if len(shape) == 5 and shape[0] == 2 and shape[1] == num_blocks and shape[2] == block_size:
        return PoolLayout.VLLM, shape[3], shape[4], True
    if len(shape) == 5 and shape[0] == num_blocks and shape[1] == 2 and shape[2] == block_size:
        return PoolLayout.VLLM_BLOCK_FIRST, shape[3], shape[4], False
    raise ValueError(f"kvwire does not know vLLM's KV layout {shape} (num_blocks {num_blocks}, block_size "
                     f"{block_size}); it knows [num_blocks, kv_heads, block_size, 2*head_dim] (CPU), "
                     "[2, num_blocks, block_size, kv_heads, head_dim] and [num_blocks, 2, block_size, kv_heads, "
                     "head_dim]")
