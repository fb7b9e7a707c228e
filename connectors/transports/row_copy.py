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
serves from then on; a consumer counts each pull into a GPU pool that ran without it
(`missing_on`: `kvwire_transport_fallbacks_total{reason="no_copy_kernel"}`, and vLLM's
`vllm:kvwire_kv_transport_fallbacks_total`). The block count is not a specialization of the kernel
(`do_not_specialize`): Triton would compile a variant for 1 block and one for multiples of 16 on
their first pulls, a second each.

The kernel trusts its table: `copy_rows` checks every block index against both sides' planes first.
"""

from __future__ import annotations

import contextlib
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
    @triton.jit(do_not_specialize=["num_blocks"])
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


def kernels_usable(device: torch.device) -> bool:
    """Whether kvwire's copy kernels (this one, piece_copy.py's) can run on `device` in this process."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: the CPU tests' way in
    return triton is not None and not _broken and (device.type == "cuda" or interpreted)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a kernel for `device` must be launched from: Triton launches on the calling thread's current device,
    which on a thread of kvwire's own (a transfer server, a pull thread) is device 0 whatever the pool's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def missing_on(device: torch.device) -> bool:
    """Whether copies on `device`, a GPU, go the slower way because the kernels cannot run in this process."""
    return device.type == "cuda" and not kernels_usable(device)


def broken(exc: Exception) -> None:
    """A kernel failed to build or launch: neither runs again in this process (logged once)."""
    _broken.append(f"{type(exc).__name__}: {exc}")
    if len(_broken) == 1:
        log.warning("kvwire's one-kernel copies cannot run here (%s); copying piece by piece and plane by plane "
                    "instead (kvwire_transport_fallbacks_total{reason=\"no_copy_kernel\"})", _broken[0][:300])


def usable(dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor]) -> bool:
    """Whether `copy_rows` can copy between these planes (see the module docstring)."""
    if not dst_planes or len(dst_planes) != len(src_planes) or not kernels_usable(dst_planes[0].device):
        return False
    device = dst_planes[0].device
    return all(p.device == device and p.dim() == 2 and p.stride(1) == 1 for p in (*dst_planes, *src_planes))


class RowTable:
    """The kernel's table for one pair of plane lists, built and uploaded once: each copy then sends only its block
    indices. Worth keeping where the same planes are copied between again and again (a consumer's pool and one
    producer's mapped planes: shm/peer.py); it holds the planes, so it must not outlive the mapping it was built for.

    Raises:
        ValueError: a pair of planes whose rows differ in size.
    """

    def __init__(self, dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor]):
        for s, d in zip(src_planes, dst_planes, strict=True):
            if s.shape[1] != d.shape[1]:
                raise ValueError(f"rows of {s.shape[1]} bytes cannot be copied into rows of {d.shape[1]}")
        self.dst_planes, self.src_planes = dst_planes, src_planes
        self._limits = (min(p.shape[0] for p in src_planes), min(p.shape[0] for p in dst_planes))
        addresses = [p.data_ptr() for pair in zip(src_planes, dst_planes) for p in pair]
        self._wide = all(a % 8 == 0 for a in addresses) and all(
            p.stride(0) % 8 == 0 and p.shape[1] % 8 == 0 for p in (*src_planes, *dst_planes))
        word = 8 if self._wide else 1
        table = torch.tensor([v for s, d in zip(src_planes, dst_planes)  # [planes * 5]
                              for v in (s.data_ptr(), s.stride(0), d.data_ptr(), d.stride(0), s.shape[1] // word)],
                             dtype=torch.int64)
        self._device = dst_planes[0].device
        self._table = table.to(self._device)  # once, synchronously: it must be there before any launch reads it
        self._chunks = triton.cdiv(max(p.shape[1] for p in src_planes) // word, WORDS_PER_PROGRAM) if triton else 0

    def copy(self, src_blocks: list[int], dst_blocks: list[int]) -> bool:
        """`dst[p][dst_blocks[i]] = src[p][src_blocks[i]]` for every plane p and i, in one launch on the current
        stream. Returns False, having copied nothing, where the kernel cannot be built here.

        Raises:
            ValueError: a block index outside a plane.
        """
        _check_blocks(self._limits, src_blocks, dst_blocks)
        if not src_blocks:
            return True
        n = len(src_blocks)
        # [m + n]: the destination ids start 16-byte aligned whatever n's parity (Triton specializes on alignment)
        m = n + n % 2
        idx = torch.tensor(src_blocks + [0] * (m - n) + dst_blocks, dtype=torch.int64)
        if self._device.type == "cuda":
            idx = idx.pin_memory().to(self._device, non_blocking=True)  # one upload
        try:
            with on_device(self._device):
                _copy_rows[(len(self.src_planes) * n, self._chunks)](self._table, idx[:n], idx[m:], n,
                                                                     WIDE=self._wide, BLOCK=WORDS_PER_PROGRAM)
        except Exception as exc:  # Triton's compile and launch errors have no common base; any means "not here"
            broken(exc)
            return False
        return True


def copy_rows(dst_planes: Sequence[torch.Tensor], src_planes: Sequence[torch.Tensor], src_blocks: list[int],
              dst_blocks: list[int]) -> bool:
    """`dst[p][dst_blocks[i]] = src[p][src_blocks[i]]` for every plane p and i, in one launch on the current stream
    (a `RowTable` built for this one copy).

    Args:
        dst_planes, src_planes: matching planes, each `[num_blocks, row_nbytes]` uint8 with contiguous rows
            (`usable`); a pair may differ in num_blocks and row stride, not in row size.
    Returns:
        False, having copied nothing, where the kernel cannot be built here (the caller copies another way).
    Raises:
        ValueError: a block index outside a plane, or a pair of planes whose rows differ in size.
    """
    return RowTable(dst_planes, src_planes).copy(src_blocks, dst_blocks)


def warm(device: torch.device) -> bool:
    """Compile the kernel for `device` (both word sizes) by copying a few bytes there; whether it can run."""
    planes = [torch.zeros(2, 16, dtype=torch.uint8, device=device), torch.zeros(2, 15, dtype=torch.uint8,
                                                                                   device=device)]
    for plane in planes:
        if not usable([plane], [plane]) or not copy_rows([plane], [plane], [0], [1]):
            return False
    return True


def _check_blocks(limits: tuple[int, int], src_blocks: list[int], dst_blocks: list[int]) -> None:
    """Every index within its side's planes (`limits`: the source's and the destination's block counts)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    for side, blocks, limit in (("source", src_blocks, limits[0]), ("destination", dst_blocks, limits[1])):
        if blocks and (min(blocks) < 0 or max(blocks) >= limit):
            raise ValueError(f"{side} block {max(blocks) if max(blocks) >= limit else min(blocks)} "
                             f"outside planes of {limit} blocks")
