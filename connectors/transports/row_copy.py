"""One kernel copies a request's blocks across every plane of a device pool, by address.

`copy_blocks` (block_copy.py) gathers and scatters stack by stack of planes: two launches and a
scratch copy each. vLLM's KV cache is one allocation per layer, so a pull into it is 2 x num_layers
launches whatever its size: on an H200 a 128-token request's 16 MiB took about 1 ms that way, and
every byte is read and written twice. Here one Triton kernel reads each plane's base address, row
stride and row size from a small table and copies every (plane, block) row straight from source to
destination: one launch, each byte read once and written once. An address is all it needs, so the
source planes may be another process's memory opened by CUDA IPC.

Used where it can be (`usable`): Triton importable (vLLM's GPU installs carry it), every plane on one
CUDA device, rows contiguous (a head slice's strided rows take block_copy's path). Triton compiles
the kernel on first use (about a second; its disk cache keeps it), so a process that will copy warms
it first (`warm`: engine/warmup.py, the vLLM connector's worker). A kernel that cannot be built here
(no C compiler for Triton's launcher, an unsupported device) is logged once and block_copy's path
serves from then on.

The kernel trusts its table: `copy_rows` checks every block index against both sides' planes first.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU build comes without it: block_copy's path serves
    triton = None

WORDS_PER_PROGRAM = 1024  # words one program copies (8 KiB of int64): a 32 KiB vLLM row is four
_broken: list[str] = []  # why the kernel cannot run in this process, once found out

if triton is not None:
    @triton.jit
    def _copy_rows(table, src_idx, dst_idx, num_blocks, WIDE: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, chunk): chunk `chunk` of block src_idx[b] of plane p to block dst_idx[b] of p."""
        row = tl.program_id(0)
        plane = row // num_blocks
        b = row % num_blocks
        entry = table + plane * 5  # a plane's entry: src address, src row stride, dst address, dst row stride, words
        src = tl.load(entry) + tl.load(src_idx + b) * tl.load(entry + 1)
        dst = tl.load(entry + 2) + tl.load(dst_idx + b) * tl.load(entry + 3)
        words = tl.load(entry + 4)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words
        if WIDE:
            s = src.to(tl.pointer_type(tl.int64))
            d = dst.to(tl.pointer_type(tl.int64))
        else:
            s = src.to(tl.pointer_type(tl.uint8))
            d = dst.to(tl.pointer_type(tl.uint8))
        tl.store(d + offs, tl.load(s + offs, mask=mask), mask=mask)


def usable(dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor]) -> bool:
    """Whether `copy_rows` can copy between these planes (see the module docstring)."""
    if triton is None or _broken or not dst_planes or len(dst_planes) != len(src_planes):
        return False
    device = dst_planes[0].device
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: the CPU tests' way in
    if device.type != "cuda" and not interpreted:
        return False
    return all(p.device == device and p.dim() == 2 and p.stride(1) == 1 for p in (*dst_planes, *src_planes))


def copy_rows(dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor], src_blocks: list[int],
              dst_blocks: list[int]) -> bool:
    """`dst[p][dst_blocks[i]] = src[p][src_blocks[i]]` for every plane p and i, in one launch on the current stream.

    Args:
        dst_planes, src_planes: matching planes, each `[num_blocks, row_nbytes]` uint8 with contiguous rows
            (`usable`); a pair may differ in num_blocks and row stride, not in row size.
    Returns:
        False, having copied nothing, where the kernel cannot be built here (the caller copies another way).
    Raises:
        ValueError: a block index outside a plane, or a pair of planes whose rows differ in size.
    """
    _check(dst_planes, src_planes, src_blocks, dst_blocks)
    if not src_blocks:
        return True
    addresses = [p.data_ptr() for pair in zip(src_planes, dst_planes) for p in pair]
    wide = all(a % 8 == 0 for a in addresses) and all(
        p.stride(0) % 8 == 0 and p.shape[1] % 8 == 0 for p in (*src_planes, *dst_planes))
    word = 8 if wide else 1
    table = [v for s, d in zip(src_planes, dst_planes)
             for v in (s.data_ptr(), s.stride(0), d.data_ptr(), d.stride(0), s.shape[1] // word)]
    payload = torch.tensor(table + src_blocks + dst_blocks, dtype=torch.int64)  # [planes * 5 + 2 * blocks]
    device = dst_planes[0].device
    if device.type == "cuda":
        payload = payload.pin_memory().to(device, non_blocking=True)  # one upload
    n_table, n = len(table), len(src_blocks)
    grid = (len(src_planes) * n, triton.cdiv(max(p.shape[1] for p in src_planes) // word, WORDS_PER_PROGRAM))
    try:
        _copy_rows[grid](payload[:n_table], payload[n_table:n_table + n], payload[n_table + n:], n,
                         WIDE=wide, BLOCK=WORDS_PER_PROGRAM)
    except Exception as exc:  # Triton's compile and launch errors have no common base; any of them means "not here"
        _broken.append(f"{type(exc).__name__}: {exc}")
        log.warning("kvwire's one-kernel block copy cannot run here (%s); copying plane by plane instead",
                    _broken[0][:300])
        return False
    return True


def warm(device: torch.device) -> bool:
    """Compile the kernel for `device` (both word sizes) by copying a few bytes there; whether it can run."""
    planes = [torch.zeros(2, 16, dtype=torch.uint8, device=device), torch.zeros(2, 15, dtype=torch.uint8,
                                                                                   device=device)]
    for plane in planes:
        if not usable([plane], [plane]) or not copy_rows([plane], [plane], [0], [1]):
            return False
    return True


def _check(dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor], src_blocks: list[int],
           dst_blocks: list[int]) -> None:
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    for s, d in zip(src_planes, dst_planes):
        if s.shape[1] != d.shape[1]:
            raise ValueError(f"rows of {s.shape[1]} bytes cannot be copied into rows of {d.shape[1]}")
    for side, blocks, planes in (("source", src_blocks, src_planes), ("destination", dst_blocks, dst_planes)):
        limit = min(p.shape[0] for p in planes)
        if blocks and (min(blocks) < 0 or max(blocks) >= limit):
            raise ValueError(f"{side} block {max(blocks) if max(blocks) >= limit else min(blocks)} "
                             f"outside planes of {limit} blocks")
