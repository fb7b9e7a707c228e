"""Device KV planes shared by CUDA IPC handle: kvwire's own CUDA pool and vLLM's per-layer KV tensors alike.

The producer exports, once per incarnation, an IPC handle for each allocation its planes lie
in (`UntypedStorage._share_cuda_()`: torch's caching allocator hands out pieces of larger
allocations, and the handle's offset says where the storage starts inside one), and where each
plane lies in its storage. The consumer opens each storage with `UntypedStorage._new_shared_cuda`,
exactly as `torch.multiprocessing.reductions` does, but the handle's fields travel as plain bytes
and ints in a msgspec struct, never pickled, and rebuilds the planes as views of them, bounds
checked against the storage. It keeps them per producer incarnation (puller.py) and drops them
with the rest of that producer's mapping; torch's IPC reference counting keeps the producer's
memory alive while a consumer holds it open. A CUDA IPC mapping cannot be made read-only; the
consumer only ever reads it.

Ordering: the producer's forward writes the KV on its own stream, so the producer synchronizes
the device before it publishes a request READY (connectors/producer/role.py), and the consumer
synchronizes after its copies, before it checks the hold word or asks the producer to confirm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.connectors.transports.shm.segment import RegionPlanes
from kvwire.connectors.wire import CudaIpcHandle, PlaneDesc, ShmAccess, ShmSegment


class CudaPlanes(RegionPlanes):
    """A producer's device planes (its region), offered by IPC handle."""

    def export(self) -> tuple[ShmSegment, list[int]]:
        """Raises:
            RuntimeError: CUDA cannot share a storage (e.g. memory not from torch's allocator).
        """
        storages: list[torch.UntypedStorage] = []
        descs: list[PlaneDesc] = []
        for plane in self.region.planes:
            storage = plane.untyped_storage()
            index = next((i for i, s in enumerate(storages) if s.data_ptr() == storage.data_ptr()), len(storages))
            if index == len(storages):
                storages.append(storage)
            descs.append(PlaneDesc(storage=index, offset=plane.data_ptr() - storage.data_ptr(),
                                   row_stride=plane.stride(0)))
        planes = self.region.planes
        msg = ShmSegment(producer=self.producer, epoch=self.epoch, num_blocks=self.num_blocks,
                         block_nbytes=planes[0].shape[1] * len(planes), access=ShmAccess.CUDA_IPC, planes=descs,
                         storages=[_handle(s) for s in storages])
        return msg, []


def _handle(storage: torch.UntypedStorage) -> CudaIpcHandle:
    device, handle, size, offset, rc_handle, rc_offset, event, sync = storage._share_cuda_()
    return CudaIpcHandle(device=int(device), handle=bytes(handle), size_bytes=int(size), offset_bytes=int(offset),
                         ref_counter_handle=bytes(rc_handle), ref_counter_offset=int(rc_offset),
                         event_handle=bytes(event or b""), event_sync_required=bool(sync))


def open_planes(msg: ShmSegment) -> tuple[torch.Tensor, ...]:
    """Consumer: a producer's planes, each `[num_blocks, row]` uint8 on its device, by IPC handle.

    Raises:
        ValueError: a plane that does not lie inside its storage, or a segment that names none.
        RuntimeError: CUDA could not open a handle.
    """
    if not msg.planes or not msg.storages or msg.block_nbytes % len(msg.planes) or msg.num_blocks <= 0:
        raise ValueError(f"a CUDA IPC segment of {len(msg.planes)} planes in {len(msg.storages)} storages")
    row = msg.block_nbytes // len(msg.planes)
    torch.cuda._lazy_init()
    storages = [_open(ipc) for ipc in msg.storages]
    out = []
    for desc in msg.planes:
        if not 0 <= desc.storage < len(storages):
            raise ValueError(f"plane in storage {desc.storage} of {len(storages)}")
        storage, ipc = storages[desc.storage], msg.storages[desc.storage]
        end = desc.offset + (msg.num_blocks - 1) * desc.row_stride + row
        if desc.offset < 0 or desc.row_stride < row or end > ipc.size_bytes:
            raise ValueError(f"plane at {desc.offset} (rows of {row} every {desc.row_stride} bytes) outside a "
                             f"storage of {ipc.size_bytes}")
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ipc.device}").set_(storage, 0, (ipc.size_bytes,), (1,))
        out.append(flat.as_strided((msg.num_blocks, row), (desc.row_stride, 1), desc.offset))
    return tuple(out)


def _open(ipc: CudaIpcHandle) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared_cuda(
        ipc.device, ipc.handle, ipc.size_bytes, ipc.offset_bytes, ipc.ref_counter_handle,
        ipc.ref_counter_offset, ipc.event_handle, ipc.event_sync_required)


def synchronize(tensors: Sequence[torch.Tensor], also: torch.device | None = None) -> None:
    """Wait for copies into or out of these tensors' CUDA devices (and `also`, a copy's source device) to finish."""
    devices = {t.device for t in tensors if t.is_cuda} | ({also} if also is not None and also.type == "cuda" else set())
    for device in devices:
        torch.cuda.synchronize(device)
