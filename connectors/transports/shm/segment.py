"""KV pools other processes on this host can read: an anonymous memfd (CUDA: cuda_ipc.py).

Lifecycle of a host segment:

1. The producer's transport creates it when asked for the pool (`SHMTransport.producer_pool`,
   shm/transport.py): `memfd_create`, sized, sealed against resizing, mapped. The engine
   uses the mapping as its KV pool.
2. The send engine hands a read-only descriptor of it to each consumer that connects.
3. `close()` closes the producer's descriptors.

The memory itself has no name anywhere (nothing in /dev/shm): it lives while some process
maps it or holds a descriptor, so it vanishes with the last of them, crash or not.

Mappings are never unmapped explicitly: `torch.frombuffer` keeps a reference to the
mmap object but not a buffer export, so closing it would unmap memory that tensors
still point at. The tensors own the mappings; dropping them unmaps.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from kvwire.connectors.hidden import fill_tensors
from kvwire.connectors.kv_pool import TORCH_DTYPES, KVPool
from kvwire.connectors.transports.kv_region import KVRegion, same_planes
from kvwire.connectors.transports.shm.channel import node_prefix
from kvwire.connectors.wire import KVLayout, ShmSegment

_SIZE_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK  # a mapping can never outgrow its file (no SIGBUS)


class PoolSegment(Protocol):
    """A producer's KV planes offered to consumers on its host: a memfd they map (HostSegment), device
    memory they open by IPC handle (cuda_ipc.CudaPlanes), host memory they read by address (cma.CmaPlanes)."""

    @property
    def num_blocks(self) -> int: ...

    def holds(self, region: KVRegion) -> bool:
        """True when `region` is exactly this segment's pool."""

    def export(self) -> tuple[ShmSegment, list[int]]:
        """The message and descriptors (owned by the segment) that let a consumer map the pool."""

    def close(self) -> None:
        """Release what the segment holds besides the pool's memory."""


@dataclass
class RegionPlanes:
    """Planes kvwire did not place in a memfd, offered where they lie (cma.CmaPlanes, cuda_ipc.CudaPlanes say how)."""

    producer: str
    epoch: int
    region: KVRegion

    @property
    def num_blocks(self) -> int:
        return self.region.num_blocks

    def holds(self, region: KVRegion) -> bool:
        return same_planes(region, self.region)

    def close(self) -> None:
        """Nothing to close: the planes are the engine's, freed with their tensors."""


@dataclass
class HostSegment:
    """A producer's KV pool inside a memfd."""

    producer: str
    epoch: int
    pool: KVPool
    _fd: int
    _ro_fd: int  # what consumers get: read-only, so they can neither write nor resize it

    @classmethod
    def create(cls, producer: str, epoch: int, layout: KVLayout, num_blocks: int) -> HostSegment:
        """Args:
            producer, epoch: the node incarnation (also names the memfd in /proc/<pid>/fd).
            layout, num_blocks: the pool's shape.
        Raises:
            ValueError: an empty pool.
            OSError: the memfd could not be created or mapped.
        """
        shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        dtype = TORCH_DTYPES[layout.dtype]
        nbytes = num_blocks * torch.Size(shape[1:]).numel() * dtype.itemsize
        if nbytes == 0:
            raise ValueError(f"node {producer}: a KV pool of {num_blocks} blocks holds no bytes")
        fd = os.memfd_create(f"kvwire-{node_prefix(producer)}-{epoch}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)
            mapped = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
            # a root tensor, not a view, so the per-layer views' `_base` is the pool (KVRegion relies on it)
            # torch's stubs want a stride too; at run time it defaults to the contiguous one
            data = torch.empty(0, dtype=dtype).set_(mapped.untyped_storage(), 0, shape)  # type: ignore[call-overload]
            ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        return cls(producer, epoch, KVPool(layout, num_blocks, data), fd, ro_fd)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def holds(self, region: KVRegion) -> bool:
        """True when `region` is exactly this segment's pool."""
        plane = region.planes[0]
        return (len(region.planes) == 1 and plane.data_ptr() == self.pool.data.data_ptr()
                and plane.numel() == self.pool.data.numel() * self.pool.data.element_size())

    def export(self) -> tuple[ShmSegment, list[int]]:
        """The message and descriptors that let a consumer map this pool (read-only)."""
        msg = ShmSegment(producer=self.producer, epoch=self.epoch, num_blocks=self.pool.num_blocks,
                         block_nbytes=self.pool.block_nbytes)
        return msg, [self._ro_fd]

    def close(self) -> None:
        """Close the descriptors; the pool stays mapped while its tensors live."""
        for fd in (self._fd, self._ro_fd):
            os.close(fd)
        self._fd = self._ro_fd = -1


def map_host(msg: ShmSegment, fd: int) -> torch.Tensor:
    """Consumer: map a producer's pool read-only as `[num_blocks, block_nbytes]` uint8.

    Raises:
        ValueError: the memfd is smaller than announced or could still shrink.
    """
    nbytes = msg.num_blocks * msg.block_nbytes
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
        raise ValueError("the pool's memfd is not sealed against shrinking")
    if nbytes <= 0 or os.fstat(fd).st_size < nbytes:
        raise ValueError(f"the pool's memfd holds {os.fstat(fd).st_size} bytes, not {nbytes}")
    view = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only on purpose: we never write the producer's pool
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.uint8).view(msg.num_blocks, msg.block_nbytes)


def pack_tensors(tensors: list[torch.Tensor]) -> int | None:
    """Copy `tensors` back to back into a new sealed memfd; None when they hold no bytes.

    Returns:
        The memfd (the caller sends and closes it).
    """
    flat = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors]
    if sum(f.numel() for f in flat) == 0:
        return None
    fd = os.memfd_create("kvwire-hidden", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        for f in flat:
            view = f.numpy().data  # memoryview(f.numpy()), as numpy types it for Python 3.11
            while view:
                view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unpack_tensors(fd: int, tensors: list[torch.Tensor]) -> int:
    """Fill `tensors` (contiguous, any device) from a memfd written by `pack_tensors`.

    Returns:
        Bytes copied.
    Raises:
        ValueError: the memfd's size or seals do not match.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    if os.fstat(fd).st_size != total or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SIZE_SEALS != _SIZE_SEALS:
        raise ValueError(f"hidden-state memfd has {os.fstat(fd).st_size} bytes or no seals; expected {total}")
    return fill_tensors(tensors, memoryview(mmap.mmap(fd, total, prot=mmap.PROT_READ)))
