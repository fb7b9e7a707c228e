"""vLLM's per-layer KV tensors seen as kvwire planes, without copying them.

vLLM (0.32) allocates one buffer for every layer's KV cache and hands the connector (in
`register_kv_caches`) one 4-D view per layer, `[B, H, N, C]`: blocks, KV heads, tokens, and
the content of one head's token (`2 * head_dim` values, K then V; MLA: the 576-wide latent,
one "head"). vLLM's resolved `KVCacheLayout` (config/cache.py, v1/kv_cache_layout.py) orders
those axes in memory:

- LBHNC (what `KvwireConnector.get_required_kvcache_layout` asks for; the CPU backend's only
  one) and BLHNC: a block's `[H, N, C]` is one contiguous run, head after head. One plane per
  layer, `[num_blocks, H * N * C]` bytes; its rows are strided under BLHNC (other layers'
  pages sit between them). Head `h` of a block is bytes `[h * row / H, (h + 1) * row / H)`
  of its row, so a tensor-parallel peer moves a head slice as one piece.
- LBNHC (vLLM's default for FlashAttention and Triton), BLNHC: heads interleave token by
  token; LHBNC, BHLNC: a block's heads are apart. `region_of` refuses these, naming the
  layout (with one head, as in MLA, every layout is head-major and is taken).

Where a backend's kernels take smaller blocks than vLLM's block manager (FlashInfer takes 16,
32 or 64 tokens; FlashMLA 64), vLLM registers kernel blocks: `B = num_blocks * r`,
`N = block_size / r`. A manager block is then `r` kernel blocks back to back, which keeps its
heads whole only with one head; with more, `region_of` refuses (`--block-size N` avoids it).

Pools (`PoolLayout`): the CPU backend reads a head's page as its N K rows then its N V rows
(`VLLM_CPU`), GPU backends each token's K and V side by side (`VLLM_HNC`), MLA one latent per
token (`VLLM_MLA`, `num_kv_heads` 1, `head_dim` the latent width). Both sides of a transfer
must have the same `KVLayout`, else the consumer refuses the pull and vLLM recomputes.

Before 0.32 vLLM registered 5-D tensors; `[2, num_blocks, block_size, kv_heads, head_dim]`
(`PoolLayout.VLLM`) and `[num_blocks, 2, block_size, kv_heads, head_dim]` (`VLLM_BLOCK_FIRST`)
are still taken when contiguous (kvwire's own tests and benchmarks build them); their rows
are not head-major.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvwire.connectors.hidden import dtype_of
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import KVLayout, PoolLayout

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionBackend


def region_of(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int, *,
              backend: type[AttentionBackend] | None = None) -> KVRegion:
    """The planes behind vLLM's per-layer KV tensors (layer order: as vLLM registers them).

    Args:
        kv_caches: layer name -> that layer's KV tensor.
        num_blocks, block_size: the block manager's (`KVCacheConfig.num_blocks`, `cache_config.block_size`).
        backend: vLLM's attention backend for these layers; it tells MLA (`is_mla()`) and the CPU
            backend's reading of a page from the others. None: not MLA, and the CPU backend's iff the
            tensors are on the CPU.
    Raises:
        ValueError: an empty dict, tensors that differ in shape or dtype, a layout whose KV heads are not
            contiguous runs of a block (the message names it and asks for LBHNC), or shapes kvwire does not
            know (the message gives the shape).
    """
    if not kv_caches:
        raise ValueError("vLLM registered no KV caches")
    tensors = list(kv_caches.values())
    first = tensors[0]
    if any((t.shape, t.stride(), t.dtype, t.device) != (first.shape, first.stride(), first.dtype, first.device)
           for t in tensors):
        raise ValueError(f"kvwire needs every layer's KV tensor alike; got {sorted({tuple(t.shape) for t in tensors})}")
    if first.dim() == 5:
        return _legacy_region(tensors, num_blocks, block_size)
    if first.dim() != 4 or first.shape[0] % num_blocks or first.shape[2] * (first.shape[0] // num_blocks) != block_size:
        raise ValueError(f"kvwire does not know vLLM's KV layout {tuple(first.shape)} (num_blocks {num_blocks}, "
                         f"block_size {block_size}); it knows vLLM's per-layer [blocks, kv_heads, block_tokens, "
                         "content] views")
    _check_head_major(tensors, num_blocks)
    pool, head_dim = _pool_of(first, backend)
    planes = tuple(_plane(t, num_blocks) for t in tensors)  # each [num_blocks, heads * block_size * content] bytes
    if planes[0].stride(0) != planes[0].shape[1]:  # BLHNC: a block's layers side by side, layer rows apart
        raise ValueError(f"vLLM resolved the KV cache layout {_layout_name(tensors)}, whose blocks hold every layer "
                         "side by side; kvwire moves a layer's blocks as runs and needs LBHNC (KvwireConnector "
                         "asks vLLM for it; VLLM_KV_CACHE_LAYOUT, if set, must be LBHNC)")
    layout = KVLayout(num_layers=len(tensors), num_kv_heads=first.shape[1], head_dim=head_dim, block_size=block_size,
                      dtype=dtype_of(first), pool=pool)
    return KVRegion(planes, layout)


def _pool_of(t: torch.Tensor, backend: type[AttentionBackend] | None) -> tuple[PoolLayout, int]:
    """`(pool, head_dim)` of a layer's `[B, H, N, C]` view: MLA's latent is one head C wide; a dense head's
    token holds K and V, C / 2 each, which the CPU backend reads as a head's K rows, then its V rows."""
    _, heads, _, content = t.shape
    if backend is not None and backend.is_mla():
        if heads != 1:
            raise ValueError(f"an MLA cache holds one latent per token, not {heads} heads: {tuple(t.shape)}")
        return PoolLayout.VLLM_MLA, content
    if content % 2:
        raise ValueError(f"kvwire does not know vLLM's KV layout {tuple(t.shape)}: a token's K and V ({content} "
                         "values) do not split in two")
    cpu = t.device.type == "cpu" if backend is None else backend.get_name() == "CPU_ATTN"
    return (PoolLayout.VLLM_CPU if cpu else PoolLayout.VLLM_HNC), content // 2


def _check_head_major(tensors: list[torch.Tensor], num_blocks: int) -> None:
    """Raises ValueError unless each manager block of a layer keeps every KV head in one contiguous run.

    That holds when a kernel block's `[H, N, C]` is dense in that order, and, where a manager block is
    `r > 1` kernel blocks (which vLLM places back to back), when there is one head.
    """
    t = tensors[0]
    blocks, heads, tokens, content = t.shape
    dense = 1
    for size, stride in ((content, t.stride(3)), (tokens, t.stride(2)), (heads, t.stride(1))):
        if size > 1 and stride != dense:
            raise ValueError(f"vLLM resolved the KV cache layout {_layout_name(tensors)}: per-layer KV tensors "
                             f"{tuple(t.shape)} with strides {t.stride()}, where a block's KV head is not one "
                             "contiguous run. kvwire needs LBHNC (KvwireConnector asks vLLM for it; "
                             "VLLM_KV_CACHE_LAYOUT, if set, must be LBHNC)")
        dense *= size
    ratio = blocks // num_blocks
    if ratio > 1 and (heads > 1 or t.stride(0) != dense):
        raise ValueError(f"vLLM splits each block of {tokens * ratio} tokens into {ratio} kernel blocks of {tokens} "
                         f"(per-layer KV tensors {tuple(t.shape)}, strides {t.stride()}), which scatters each of "
                         f"its {heads} KV heads; serve with --block-size {tokens} for kvwire")


def _plane(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """One layer's `[B, H, N, C]` view (head-major, `_check_head_major`) as `[num_blocks, row]` uint8 rows."""
    ratio = t.shape[0] // num_blocks
    raw = t.view(torch.uint8)  # [B, H, N, C * itemsize]; C's stride is 1
    row = raw[0].numel() * ratio
    return raw.as_strided((num_blocks, row), (raw.stride(0) * ratio, 1))


def _layout_name(tensors: list[torch.Tensor]) -> str:
    """vLLM's `KVCacheLayout` name for these views: axes L, B, H, N, C from the widest stride to the narrowest
    (L's: from the first two layers' addresses; outermost with one layer)."""
    t = tensors[0]
    size = t.element_size()
    strides = dict(zip("BHNC", (s * size for s in t.stride())))
    layer = tensors[1].data_ptr() - t.data_ptr() if len(tensors) > 1 else 0
    strides["L"] = layer if layer > 0 else max(strides.values()) + 1
    return "".join(sorted(strides, key=lambda axis: -strides[axis]))


def _legacy_region(tensors: list[torch.Tensor], num_blocks: int, block_size: int) -> KVRegion:
    """Pre-0.32 vLLM's contiguous 5-D layouts (see the module docstring)."""
    first = tensors[0]
    shape = tuple(first.shape)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"kvwire moves contiguous 5-D KV tensors only; layer tensors have shape {shape} "
                         f"and strides {first.stride()}")
    if shape[0] == 2 and shape[1] == num_blocks and shape[2] == block_size:
        pool, halves = PoolLayout.VLLM, [t[half] for t in tensors for half in (0, 1)]  # a K and a V plane
    elif shape[0] == num_blocks and shape[1] == 2 and shape[2] == block_size:
        pool, halves = PoolLayout.VLLM_BLOCK_FIRST, tensors
    else:
        raise ValueError(f"kvwire does not know vLLM's KV layout {shape} (num_blocks {num_blocks}, block_size "
                         f"{block_size}); it knows [2, num_blocks, block_size, kv_heads, head_dim] and "
                         "[num_blocks, 2, block_size, kv_heads, head_dim]")
    planes = tuple(h.reshape(num_blocks, -1).view(torch.uint8) for h in halves)
    layout = KVLayout(num_layers=len(tensors), num_kv_heads=shape[3], head_dim=shape[4], block_size=block_size,
                      dtype=dtype_of(first), pool=pool)
    return KVRegion(planes, layout)
