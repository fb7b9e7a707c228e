"""Copy a request's blocks between two pools' planes in a few launches, not one `copy_` per piece.

A piece is one run of blocks consecutive on both sides, in one plane (kv_region.py). A
`copy_` per piece costs one kernel launch on a GPU (and a few microseconds of Python
either way), so vLLM's per-layer pool, 2 x num_layers planes, pays thousands of them for
one request. `copy_blocks` instead gathers the blocks by index out of every source plane
and scatters them into the destination plane (`index_select` + `index_copy_`): two
launches per plane, and planes that sit in one allocation at a fixed stride (a vLLM
layer's K and V, or layers allocated together) are stacked and moved together.

The price is a scratch copy: every byte is read and written twice. A GPU always pays it
(launches, not bandwidth, bound a copy of many pieces); on the host the per-piece copies
win unless the pieces are small and many (`batched_pays`; measured on a 2-core host: 512
pieces of 4 KiB 1.3 ms a copy_ per piece, 0.4-0.7 ms batched; 128 pieces of 2 MiB 20-32 ms
per piece, 49-56 ms batched; 64 KiB pieces still favour a copy_ per piece by ~1.5x).

On a GPU, where Triton can build it, one kernel copies every plane's blocks by address instead, with
no scratch (row_copy.py); the gather/scatter is the path where it cannot.

`gather_parts` / `scatter_parts` do the same for flat pieces that have lost their block
structure (a transport's parts staged through a host buffer): `torch.cat` and
`torch.split_with_sizes_copy`, which launch one kernel per up to 128 pieces on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.connectors.transports import row_copy

Run = tuple[int, int, int]  # (src_start, dst_start, num_blocks)

HOST_BATCH_BELOW = 16 << 10  # on the host, batch only pieces smaller than this on average (measured) ...
HOST_BATCH_MIN_PIECES = 32  # ... and at least this many: a gather/scatter costs ~30 us a plane, a copy_ ~3 us
SCRATCH_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}  # scratch per round; a larger fresh host buffer page-faults
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first: a gather moves words, not bytes


def batched_pays(device: torch.device, runs: list[Run], row_nbytes: int, num_planes: int = 1) -> bool:
    """Whether a gather/scatter beats a `copy_` per piece on `device` (planes' rows of `row_nbytes` bytes).

    One run is one `copy_` per plane, no scratch: never worse than a gather/scatter (two launches a stack).
    """
    if len(runs) < 2:
        return False
    if device.type != "cpu":
        return True
    blocks = sum(n for _, _, n in runs)
    return len(runs) * num_planes >= HOST_BATCH_MIN_PIECES and blocks * row_nbytes < HOST_BATCH_BELOW * len(runs)


def copy_blocks(dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor], runs: list[Run],
                batched: bool | None = None) -> None:
    """`dst[d:d+n] = src[s:s+n]` for every pair of planes and every run `(s, d, n)`.

    Args:
        dst_planes, src_planes: matching planes, each `[num_blocks, plane_block_nbytes]` uint8 with
            contiguous rows; the two sides may differ in num_blocks, not in row size or device.
        runs: `(src_start, dst_start, num_blocks)` triples (kv_region.plan_runs).
        batched: gather/scatter by block index (True; on a GPU the one-kernel copy where it can run), one
            `copy_` per run (False), or `batched_pays` (None; likewise).
    Raises:
        ValueError: the sides differ in their number of planes.
    """
    if len(dst_planes) != len(src_planes):
        raise ValueError(f"{len(src_planes)} source planes but {len(dst_planes)} destination planes")
    if not runs or not dst_planes:
        return
    if dst_planes[0].device.type == "cuda" and batched is not False and row_copy.usable(dst_planes, src_planes):
        if row_copy.copy_rows(dst_planes, src_planes, *block_lists(runs)):
            return
    if batched is None:
        batched = batched_pays(dst_planes[0].device, runs, dst_planes[0].shape[1], len(dst_planes))
    if not batched:
        for dst, src in zip(dst_planes, src_planes):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n])
        return
    src_idx, dst_idx = block_indices(runs, dst_planes[0].device)
    src_idx = src_idx.to(src_planes[0].device)  # the sides may sit on two devices (CUDA IPC from another GPU)
    for dst, src in plane_groups(dst_planes, src_planes):
        _gather_scatter(dst, src, src_idx, dst_idx)


def block_lists(runs: list[Run]) -> tuple[list[int], list[int]]:
    """Every block of `runs`, source side and destination side, in order."""
    return [s + k for s, _, n in runs for k in range(n)], [d + k for _, d, n in runs for k in range(n)]


def block_indices(runs: list[Run], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of `runs`, source side and destination side: two `[num_blocks]` int64 tensors on `device`."""
    idx = torch.tensor(block_lists(runs), dtype=torch.int64)  # [2, blocks]
    if device.type != "cpu":
        idx = idx.pin_memory().to(device, non_blocking=True)  # one upload for both sides
    return idx[0], idx[1]


def plane_groups(dst_planes: Sequence[torch.Tensor],
                 src_planes: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching planes stacked where both sides allow: `(dst, src)` views `[planes, num_blocks, row_words]`.

    Consecutive planes stack when, on both sides, they share storage, shape and strides and each
    starts a fixed number of bytes after the last (a vLLM layer's K and V planes). Rows are seen
    as the widest words that divide every row and offset, so a gather moves 8 bytes at a time.
    """
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = 0
    while start < len(dst_planes):
        end = start + 1
        while end < len(dst_planes) and _stacks(dst_planes, start, end) and _stacks(src_planes, start, end):
            end += 1
        dsts, srcs = dst_planes[start:end], src_planes[start:end]
        word = _word(list(dsts) + list(srcs))
        out.append((_stack(dsts, word), _stack(srcs, word)))
        start = end
    return out


def _stacks(planes: Sequence[torch.Tensor], start: int, end: int) -> bool:
    """Whether plane `end` continues the stack `planes[start:end]` (same storage, fixed step)."""
    first, prev, nxt = planes[start], planes[end - 1], planes[end]
    if nxt.shape != first.shape or nxt.stride() != first.stride():
        return False
    if nxt.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return False
    step = planes[start + 1].data_ptr() - first.data_ptr() if end > start + 1 else nxt.data_ptr() - first.data_ptr()
    extent = first.shape[0] * first.stride(0)
    return step >= extent and nxt.data_ptr() - prev.data_ptr() == step  # disjoint planes, evenly spaced


def _word(planes: list[torch.Tensor]) -> torch.dtype:
    """The widest dtype whose size divides every plane's row size, row stride and address."""
    for dtype in _WORDS:
        size = dtype.itemsize
        if all(p.shape[1] % size == 0 and p.stride(0) % size == 0 and p.data_ptr() % size == 0 for p in planes):
            return dtype
    return torch.uint8


def _stack(planes: Sequence[torch.Tensor], word: torch.dtype) -> torch.Tensor:
    """`planes` (stacking, per `_stacks`) as one `[planes, num_blocks, row_words]` view of `word`s."""
    first = planes[0].view(word)  # [num_blocks, row_words]
    if len(planes) == 1:
        return first.unsqueeze(0)
    step = (planes[1].data_ptr() - planes[0].data_ptr()) // word.itemsize
    return first.as_strided((len(planes), *first.shape), (step, *first.stride()), first.storage_offset())


def _gather_scatter(dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """`dst[:, dst_idx] = src[:, src_idx]`; dst, src: `[planes, num_blocks, row_words]`, in rounds of SCRATCH_BYTES."""
    row_bytes = dst.shape[0] * dst.shape[2] * dst.element_size()
    step = max(1, SCRATCH_BYTES.get(dst.device.type, SCRATCH_BYTES["cuda"]) // row_bytes)
    for lo in range(0, src_idx.numel(), step):
        scratch = src.index_select(1, src_idx[lo:lo + step])  # [planes, step, row_words], on src's device
        dst.index_copy_(1, dst_idx[lo:lo + step], scratch.to(dst.device))


def gather_parts(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """`out[:total]` = `parts` back to back; a device's parts are joined there, then cross in one copy.

    Args:
        parts: flat uint8 tensors, all on one device.
        out: a flat uint8 tensor (e.g. pinned host memory) of at least their total size.
    """
    total = sum(p.numel() for p in parts)
    if not parts:
        return
    if len(parts) == 1:
        out[:total].copy_(parts[0])
    elif out.device == parts[0].device:
        torch.cat(parts, out=out[:total])
    else:
        out[:total].copy_(torch.cat(parts))  # [total] scratch on the parts' device


def scatter_parts(src: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """`parts` = `src[:total]` cut in order; the inverse of `gather_parts`. src: flat uint8, any device."""
    sizes = [p.numel() for p in parts]
    total = sum(sizes)
    if not parts:
        return
    if len(parts) == 1:
        parts[0].copy_(src[:total])
        return
    if src.device != parts[0].device:
        src = src[:total].to(parts[0].device)  # [total] scratch on the parts' device; waits for the copy
    torch.split_with_sizes_copy(src[:total], sizes, out=parts)
