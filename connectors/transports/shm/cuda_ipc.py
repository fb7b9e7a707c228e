"""CUDA pools shared by CUDA IPC handles (run on one H100: README, Known limits).

The producer allocates its pool as usual on its device and exports the storage's IPC
handle with `UntypedStorage._share_cuda_()`; the consumer opens it with
`UntypedStorage._new_shared_cuda(...)`, exactly as `torch.multiprocessing.reductions`
does, but the handle's fields travel as plain bytes and ints in a msgspec struct,
never pickled. The consumer keeps the opened storage per producer incarnation and drops
it with the rest of that producer's mapping. torch's IPC reference counting keeps the
producer's memory alive while a consumer holds it open. Unlike a memfd, a CUDA IPC
mapping cannot be made read-only; the consumer only ever reads it.

Ordering: the producer's forward writes the KV on its own stream, so the producer
synchronizes the device before it publishes a request READY (connectors/producer/role.py), and
the consumer synchronizes after its copies, before it asks the producer to confirm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import CudaIpcHandle, KVLayout, ShmSegment


@dataclass
class CudaSegment:
    """A producer's KV pool in device memory, exported by IPC handle."""

    producer: str
    epoch: int
    pool: KVPool

    @classmethod
    def create(cls, producer: str, epoch: int, layout: KVLayout, num_blocks: int,
               device: torch.device) -> CudaSegment:
        return cls(producer, epoch, KVPool.allocate(layout, num_blocks, device))

    def holds(self, region: KVRegion) -> bool:
        plane = region.planes[0]
        return len(region.planes) == 1 and plane.data_ptr() == self.pool.data.data_ptr()

    def export(self) -> tuple[ShmSegment, list[int]]:
        storage = self.pool.data.untyped_storage()
        device, handle, size, offset, rc_handle, rc_offset, event, sync = storage._share_cuda_()
        ipc = CudaIpcHandle(device=int(device), handle=bytes(handle), size_bytes=int(size),
                            offset_bytes=int(offset), ref_counter_handle=bytes(rc_handle),
                            ref_counter_offset=int(rc_offset), event_handle=bytes(event or b""),
                            event_sync_required=bool(sync))
        msg = ShmSegment(producer=self.producer, epoch=self.epoch, num_blocks=self.pool.num_blocks,
                         block_nbytes=self.pool.block_nbytes, cuda=ipc)
        return msg, []

    def close(self) -> None:
        """Nothing to close: the pool is freed with its tensor."""


def map_cuda(msg: ShmSegment) -> torch.Tensor:
    """Consumer: open a producer's pool as `[num_blocks, block_nbytes]` uint8 on its device.

    Raises:
        ValueError: the storage is smaller than announced.
        RuntimeError: CUDA could not open the handle.
    """
    ipc = msg.cuda
    nbytes = msg.num_blocks * msg.block_nbytes
    if ipc is None or nbytes <= 0 or ipc.size_bytes < nbytes:
        raise ValueError(f"CUDA IPC storage of {ipc and ipc.size_bytes} bytes cannot hold {nbytes}")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        ipc.device, ipc.handle, ipc.size_bytes, ipc.offset_bytes, ipc.ref_counter_handle,
        ipc.ref_counter_offset, ipc.event_handle, ipc.event_sync_required)
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ipc.device}").set_(storage, 0, (nbytes,), (1,))
    return flat.view(msg.num_blocks, msg.block_nbytes)


def synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for copies into or out of these tensors' CUDA devices to finish."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)
