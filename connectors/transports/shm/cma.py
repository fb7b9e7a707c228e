"""Host KV planes kvwire did not allocate (vLLM's CPU KV cache), read with cross-memory attach.

vLLM allocates its KV cache itself, so it cannot live in a memfd that consumers map. A consumer
on the same host can still read it straight from the producer's memory: `process_vm_readv`
copies from another process's address space in one system call per up to IOV_MAX pieces, with
the same one copy as a mapped pool. Nothing is shared but addresses.

Lifecycle:

1. Producer: `CmaPlanes(producer, epoch, region)` describes the region's planes by address
   (`export`); no descriptors, nothing to close.
2. Consumer: `CmaReader(pid, segment)` for the process at the other end of the producer's Unix
   socket (SO_PEERCRED: the kernel's word, not the producer's), once per producer epoch, with a
   `probe` read of one row: a kernel or sandbox that refuses cross-memory attach (EPERM: another
   user, Yama's ptrace_scope, a seccomp profile) is known before any pull relies on it.
3. `copy` moves a pull's runs (and head slices) in as few pieces as the rows allow. A pull between pools of
   different block sizes (sub-blocks) reads the producer's rows that hold them whole into a staging buffer,
   STAGING_BYTES at a time, and copies each sub-block to its place from there (`copy_sub_blocks`): reading them
   piece by piece was a million 128-byte pieces for a 2,048-token Llama-3-8B request in vLLM's CPU layout.

A producer that died, or whose memory is gone, is a plain error of the read (ESRCH, EFAULT, or a
short read), raised as `CmaError`; never a signal. The hold protocol around the read
(puller.py) decides whether what was read stands, exactly as for a mapped pool: the kernel's
copy reads the producer's pages with ordinary loads on this CPU before the hold word is read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import threading

import numpy as np
import torch

from kvwire.connectors.transports.block_copy import Run
from kvwire.connectors.transports.kv_region import KVRegion, blocks_of, head_rows
from kvwire.connectors.transports.shm.copier import BlockCopier
from kvwire.connectors.transports.shm.segment import RegionPlanes
from kvwire.connectors.transports.sub_blocks import SubBlocks, copy_sub_blocks
from kvwire.connectors.wire import HeadSlice, KVLayout, PlaneDesc, ShmAccess, ShmSegment

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
STAGING_BYTES = 64 << 20  # a pull of sub-blocks reads the producer's rows this much at a time
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_readv = _libc.process_vm_readv
_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_readv.restype = ctypes.c_ssize_t


class CmaError(OSError):
    """A cross-memory read failed (`errno` says why: EPERM refused, ESRCH the producer is gone, EFAULT its
    memory is)."""

    @property
    def refused(self) -> bool:
        """The kernel does not let this process read the producer's (and never will: another transport)."""
        return self.errno in (errno.EPERM, errno.EACCES, errno.ENOSYS)


class CmaPlanes(RegionPlanes):
    """A producer's host planes, offered by address."""

    def export(self) -> tuple[ShmSegment, list[int]]:
        planes = self.region.planes
        descs = [PlaneDesc(storage=0, offset=p.data_ptr(), row_stride=p.stride(0)) for p in planes]
        msg = ShmSegment(producer=self.producer, epoch=self.epoch, num_blocks=self.num_blocks,
                         block_nbytes=planes[0].shape[1] * len(planes), access=ShmAccess.CMA, planes=descs)
        return msg, []


class CmaReader:
    """The consumer's reader of one producer incarnation's planes."""

    access = ShmAccess.CMA

    def __init__(self, pid: int, segment: ShmSegment):
        """Raises:
            ValueError: a segment that describes no planes, or planes unlike each other.
        """
        if not segment.planes or segment.block_nbytes % len(segment.planes):
            raise ValueError(f"a cma segment of {len(segment.planes)} planes and {segment.block_nbytes} bytes a block")
        self.pid = pid
        self.num_blocks = segment.num_blocks
        self.num_planes = len(segment.planes)
        self.row_nbytes = segment.block_nbytes // self.num_planes
        self._base = np.array([p.offset for p in segment.planes], dtype=np.uint64)  # [planes]
        self._stride = np.array([p.row_stride for p in segment.planes], dtype=np.uint64)  # [planes]
        self._local = threading.local()  # each pulling thread's staging buffer (sub-blocks)

    def probe(self) -> None:
        """Read one row of the first plane, to learn now whether the kernel lets us.

        Raises:
            CmaError: refused or failed; refused also where the producer's process is not visible from here
                (SO_PEERCRED gives pid 0 across PID namespaces).
        """
        if self.pid <= 0:
            raise CmaError(errno.EPERM, "the producer's process is in a PID namespace this one cannot see")
        scratch = torch.empty(min(self.row_nbytes, 4096), dtype=torch.uint8)
        local = np.array([[scratch.data_ptr(), scratch.numel()]], dtype=np.uint64)
        remote = np.array([[int(self._base[0]), scratch.numel()]], dtype=np.uint64)
        _read(self.pid, local, remote)

    def copy(self, dst: KVRegion, src_layout: KVLayout, heads: HeadSlice | None, runs: list[Run],
             copier: BlockCopier | None = None) -> int:
        """`dst`'s blocks of `runs` from the producer's, every plane, split over `copier`'s lanes when it is worth
        it; returns the bytes read.

        Args:
            dst: our region, narrowed to the head slice it receives, if any (its `rows`).
            src_layout: the producer's layout (its KV heads per row).
            heads: the slice of the producer's rows read (`src_head`, `num_heads`); None: whole rows.
            runs: `(src_start, dst_start, num_blocks)`, checked to lie inside both pools.
        Raises:
            CmaError: the read failed or was short.
            ValueError: planes or row slices that do not pair.
        """
        if len(dst.planes) != self.num_planes:
            raise ValueError(f"{self.num_planes} producer planes for {len(dst.planes)} of ours")
        if dst.split is not None:
            return self._copy_sub_blocks(dst, src_layout, heads, runs, copier)
        rows = None if heads is None else head_rows(src_layout, self.row_nbytes, heads.src_head, heads.num_heads,
                                                     heads.per_block)
        s_lo, s_hi = rows or (0, self.row_nbytes)
        d_lo, d_hi = dst.rows or (0, dst.planes[0].shape[1])
        if s_hi - s_lo != d_hi - d_lo:
            raise ValueError(f"producer rows of {s_hi - s_lo} bytes for ours of {d_hi - d_lo}")
        local, remote = _pieces(dst, d_lo, self._base + np.uint64(s_lo), self._stride, s_hi - s_lo, runs)
        return self._read_all(local, remote, copier)

    def _copy_sub_blocks(self, dst: KVRegion, src_layout: KVLayout, heads: HeadSlice | None, runs: list[Run],
                         copier: BlockCopier | None) -> int:
        """`copy` of sub-blocks (module docstring, step 3); the bytes of the sub-blocks copied."""
        assert dst.split is not None
        theirs = _their_sub_blocks(dst.split, src_layout, heads, self.row_nbytes)
        src_ids, dst_ids = blocks_of([(s, n) for s, _, n in runs]), blocks_of([(d, n) for _, d, n in runs])
        unit = theirs.block_nbytes * theirs.ratio // theirs.units  # a unit's bytes in a whole row
        lo, width = theirs.first_unit * unit, theirs.units * unit  # the slice of a row read
        staged = SubBlocks(theirs.ratio, theirs.tokens, theirs.units, theirs.parts)  # a staging row: the slice alone
        rows = src_ids // theirs.ratio
        needed = torch.unique(rows)  # [rows], sorted
        per_chunk = max(1, STAGING_BYTES // (width * self.num_planes))
        for at in range(0, len(needed), per_chunk):
            chunk = needed[at:at + per_chunk]
            staging = self._staging(len(chunk) * width * self.num_planes).view(self.num_planes, len(chunk), width)
            remote = (self._base[:, None] + np.uint64(lo) + chunk.numpy().astype(np.uint64)[None, :]
                      * self._stride[:, None]).reshape(-1)  # [planes * rows]
            local = (np.uint64(staging.data_ptr()) + np.arange(len(chunk) * self.num_planes, dtype=np.uint64)
                     * np.uint64(width))
            self._read_all(*_merged(local, remote, width), copier)
            mine = (rows >= chunk[0]) & (rows <= chunk[-1])
            place = torch.searchsorted(chunk, rows[mine]) * theirs.ratio + src_ids[mine] % theirs.ratio
            copy_sub_blocks(list(staging), staged, place, dst.planes, dst.split, dst_ids[mine])
        return len(src_ids) * dst.split.block_nbytes * self.num_planes

    def _staging(self, nbytes: int) -> torch.Tensor:
        """This thread's staging buffer, at least `nbytes` (kept: its pages are touched once, not every pull)."""
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.staging = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def _read_all(self, local: np.ndarray, remote: np.ndarray, copier: BlockCopier | None) -> int:
        """Read the pieces `(local, remote)`, split over `copier`'s lanes when it is worth it; the bytes read."""
        total = int(local[:, 1].sum())
        if copier is None or not copier.parallel(total) or local.shape[0] < 2:
            return _read(self.pid, local, remote)
        bounds = np.searchsorted(np.cumsum(local[:, 1]), [total * k // copier.lanes for k in range(1, copier.lanes)])
        shares = [(lo, hi) for lo, hi in zip([0, *bounds], [*bounds, local.shape[0]]) if hi > lo]
        copier.run([functools.partial(_read, self.pid, local[lo:hi], remote[lo:hi]) for lo, hi in shares])
        return total


def _pieces(dst: KVRegion, d_lo: int, src_base: np.ndarray, src_stride: np.ndarray, width: int,
            runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
    """`(local, remote)` iovec arrays `[pieces, 2]` (address, length): every plane's block rows of `runs`,
    plane by plane, adjacent pieces merged where both sides continue each other."""
    src = np.concatenate([np.arange(s, s + n, dtype=np.uint64) for s, _, n in runs])  # [blocks]
    dst_idx = np.concatenate([np.arange(d, d + n, dtype=np.uint64) for _, d, n in runs])  # [blocks]
    d_base = np.array([p.data_ptr() for p in dst.planes], dtype=np.uint64) + np.uint64(d_lo)  # [planes]
    d_stride = np.array([p.stride(0) for p in dst.planes], dtype=np.uint64)  # [planes]
    remote = (src_base[:, None] + src[None, :] * src_stride[:, None]).reshape(-1)  # [planes * blocks]
    local = (d_base[:, None] + dst_idx[None, :] * d_stride[:, None]).reshape(-1)  # [planes * blocks]
    return _merged(local, remote, width)


def _merged(local: np.ndarray, remote: np.ndarray, width: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(local, remote)` iovec arrays `[pieces, 2]` of pieces at these addresses (uint64) of `width` bytes (one for
    all, or each its own), adjacent pieces merged where both sides continue each other."""
    w = np.broadcast_to(np.asarray(width, dtype=np.uint64), remote.shape)
    starts = np.flatnonzero(np.concatenate([[True], (remote[:-1] + w[:-1] != remote[1:])
                                            | (local[:-1] + w[:-1] != local[1:])]))
    ends = np.cumsum(w, dtype=np.uint64)  # [pieces]: where each piece ends, counted from the first's start
    lengths = np.diff(np.append(ends[starts] - w[starts], ends[-1] if ends.size else 0)).astype(np.uint64)
    return np.stack([local[starts], lengths], 1), np.stack([remote[starts], lengths], 1)  # each [pieces, 2]


def _their_sub_blocks(ours: SubBlocks, src_layout: KVLayout, heads: HeadSlice | None,
                      src_row: int) -> SubBlocks:
    """The producer's rows (of `src_layout`'s blocks, `src_row` bytes) seen in our sub-blocks, of the head slice
    `heads` if any (connectors/transports/sub_blocks.py).

    Raises:
        ValueError: sub-blocks that do not pair with ours.
    """
    sliced = heads is not None and (heads.per_block or heads.num_heads != src_layout.num_kv_heads)
    theirs = SubBlocks.of(src_layout, ours.tokens, src_row,
                          (heads.src_head, heads.num_heads) if heads is not None and sliced else None)
    if (theirs.units, theirs.parts) != (ours.units, ours.parts):
        raise ValueError(f"producer sub-blocks {theirs} do not pair with ours {ours}")
    return theirs


def _read(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """process_vm_readv of the pieces, IOV_MAX a call; the bytes read. Raises CmaError (also on a short read)."""
    local, remote = np.ascontiguousarray(local, dtype=np.uint64), np.ascontiguousarray(remote, dtype=np.uint64)
    total = 0
    for lo in range(0, local.shape[0], IOV_MAX):
        l_chunk, r_chunk = local[lo:lo + IOV_MAX], remote[lo:lo + IOV_MAX]
        want = int(l_chunk[:, 1].sum())
        got = _readv(pid, l_chunk.ctypes.data, l_chunk.shape[0], r_chunk.ctypes.data, r_chunk.shape[0], 0)
        if got < 0:
            err = ctypes.get_errno()
            raise CmaError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got != want:
            raise CmaError(errno.EFAULT, f"process_vm_readv from pid {pid}: {got} of {want} bytes (memory gone)")
        total += got
    return total
