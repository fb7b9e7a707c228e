"""What a consumer opened of one producer incarnation's KV planes, and the one copy out of them.

`open_peer` turns the producer's `ShmSegment` into a `PeerPlanes` by its access:

- memfd (kvwire's host pool): the pool mapped read-only, one plane (segment.py);
- CUDA IPC (any device planes: kvwire's CUDA pool, vLLM's per-layer KV tensors): each allocation
  opened by handle, the planes views of them (cuda_ipc.py);
- cma (host planes kvwire did not allocate: vLLM's CPU KV cache): read by address from the
  producer's process with process_vm_readv (cma.py), probed once here.

Either way a pull is one batched copy over every plane, straight from the producer's memory into
the consumer's blocks (a head slice: the matching columns of each row on both sides), with no
staging. The puller (puller.py) keeps one `PeerPlanes` per producer epoch and drops it with the
producer's connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvwire.connectors.transports import row_copy
from kvwire.connectors.transports.block_copy import Run, block_lists
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.row_copy import RowTable
from kvwire.connectors.transports.shm.cma import CmaReader
from kvwire.connectors.transports.shm.copier import BlockCopier
from kvwire.connectors.transports.shm.segment import map_host
from kvwire.connectors.wire import HeadSlice, KVLayout, ShmAccess, ShmSegment


class PeerPlanes(Protocol):
    @property
    def access(self) -> ShmAccess: ...

    @property
    def device(self) -> torch.device:
        """Where the copy out of these planes runs (the planes' device; cross-memory attach: the CPU)."""
        ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_planes(self) -> int: ...

    @property
    def row_nbytes(self) -> int: ...

    def copy(self, dst: KVRegion, src_layout: KVLayout, heads: HeadSlice | None, runs: list[Run]) -> None:
        """`dst`'s blocks of `runs` from the producer's (`dst` narrowed to the slice it receives, `heads` the slice
        of the producer's rows read; None: whole rows). Raises OSError or ValueError when the copy fails."""
        ...


@dataclass
class MappedPlanes:
    """Planes in this process's address space: a mapped memfd or CUDA IPC storages. A whole-row copy into one
    destination's planes again and again (a consumer's pool) keeps the row kernel's table for them (row_copy.py:
    built once per mapping, dropped with it)."""

    access: ShmAccess
    planes: tuple[torch.Tensor, ...]  # each [num_blocks, row_nbytes] uint8; never written
    copier: BlockCopier
    _rows: tuple[Sequence[torch.Tensor], RowTable | None] | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def num_blocks(self) -> int:
        return self.planes[0].shape[0]

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def row_nbytes(self) -> int:
        return self.planes[0].shape[1]

    def copy(self, dst: KVRegion, src_layout: KVLayout, heads: HeadSlice | None, runs: list[Run]) -> None:
        if heads is None and (table := self._row_table(dst.row_views())) is not None \
                and table.copy(*block_lists(runs)):
            return
        src = KVRegion(self.planes, src_layout)
        if heads is not None:
            src = src.heads(heads.src_head, heads.num_heads, heads.per_block)
        self.copier.copy(dst.row_views(), src.row_views(), runs)

    def _row_table(self, dst_planes: Sequence[torch.Tensor]) -> RowTable | None:
        """The row kernel's table from these planes into `dst_planes` (whole rows), made on the first copy into
        them; None where the kernel does not serve (a host pool, no Triton: block_copy's path)."""
        if self._rows is None or self._rows[0] is not dst_planes:
            usable = self.device.type == "cuda" and row_copy.usable(dst_planes, self.planes)
            table = RowTable(dst_planes, self.planes) if usable else None
            self._rows = (dst_planes, table)
        return self._rows[1]


@dataclass
class ReadPlanes:
    """Planes in the producer's address space, read by cross-memory attach."""

    reader: CmaReader
    copier: BlockCopier
    access: ShmAccess = ShmAccess.CMA

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def num_blocks(self) -> int:
        return self.reader.num_blocks

    @property
    def num_planes(self) -> int:
        return self.reader.num_planes

    @property
    def row_nbytes(self) -> int:
        return self.reader.row_nbytes

    def copy(self, dst: KVRegion, src_layout: KVLayout, heads: HeadSlice | None, runs: list[Run]) -> None:
        self.reader.copy(dst, src_layout, heads, runs, self.copier)


def open_peer(segment: ShmSegment, fds: list[int], pid: int, copier: BlockCopier) -> PeerPlanes:
    """The producer's planes as `segment` offers them.

    Args:
        fds: the descriptors that came with it (the memfd's, for that access).
        pid: the producer's process (SO_PEERCRED of the connection), for cross-memory attach.
    Raises:
        ValueError: a segment that does not describe what its access needs.
        OSError: the memfd cannot be mapped, or cross-memory attach is refused (cma.CmaError).
        RuntimeError: CUDA cannot open a handle.
    """
    if segment.access == ShmAccess.MEMFD:
        if len(fds) != 1:
            raise ValueError(f"{len(fds)} descriptors with the pool, expected 1")
        return MappedPlanes(segment.access, (map_host(segment, fds[0]),), copier)
    if fds:
        raise ValueError(f"{len(fds)} descriptors with a {segment.access} pool, expected none")
    if segment.access == ShmAccess.CUDA_IPC:
        from kvwire.connectors.transports.shm.cuda_ipc import open_planes  # needs CUDA: imported only for it

        return MappedPlanes(segment.access, open_planes(segment), copier)
    reader = CmaReader(pid, segment)
    reader.probe()
    return ReadPlanes(reader, copier)
