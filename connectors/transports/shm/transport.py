"""The shared-memory transport: consumers on the producer's host read its KV planes themselves.

1. `producer_pool` places a kvwire engine's host pool in a memfd segment named for the node and
   epoch (a CUDA pool is ordinary device memory).
2. `send_engines` serves the region's planes over the node's private Unix socket: the memfd
   segment where the pool is one; otherwise (a CUDA pool, vLLM's KV tensors) device planes by CUDA
   IPC handle (cuda_ipc.py) or host planes by address, for cross-memory attach (cma.py).
   `puller` maps or opens producers' planes and copies out of them (puller.py).
3. `close()` closes the segment's descriptors; its memory goes with the last process that
   maps it, so a crash leaves nothing behind but a socket file, which the node's next
   incarnation removes.
"""

from __future__ import annotations

import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.shm.cma import CmaPlanes
from kvwire.connectors.transports.shm.puller import SHMPuller
from kvwire.connectors.transports.shm.segment import HostSegment, PoolSegment
from kvwire.connectors.transports.shm.send_engine import SHMSendEngine
from kvwire.connectors.transports.transport import Puller, SendEngine, Transport
from kvwire.connectors.wire import KVLayout, KVLocation


class SHMTransport(Transport):
    kind = ConnectorKind.SHM
    _segment: PoolSegment | None = None

    def producer_pool(self, layout: KVLayout, num_blocks: int, device: str | torch.device) -> KVPool:
        """Raises:
        RuntimeError: the pool was already allocated.
        OSError: the memfd could not be created.
        ValueError: shared memory cannot hold a pool on `device`.
        """
        if self._segment is not None:
            raise RuntimeError(f"node {self.config.node_id}: the KV pool is allocated once")
        device = torch.device(device)
        if device.type == "cuda":  # shared by IPC handle from wherever it lies (send_engines)
            return KVPool.allocate(layout, num_blocks, device)
        if device.type != "cpu":
            raise ValueError(f"node {self.config.node_id}: shared memory cannot hold a pool on {device}")
        segment = HostSegment.create(self.config.node_id, self.epoch, layout, num_blocks)
        self._segment = segment
        return segment.pool

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {self.kind: self._send_engine(region)}

    def _send_engine(self, region: KVRegion) -> SHMSendEngine:
        """Raises:
            ValueError: a host region beside the memfd pool this transport made, or planes on another device.
        """
        if self._segment is None:
            self._segment = self._exported(region)
        elif not self._segment.holds(region):
            raise ValueError(f"node {self.config.node_id}: serve the pool from producer_pool; "
                             "consumers can read only that one")
        return SHMSendEngine(self.config.node_id, self.epoch, self._segment)

    def _exported(self, region: KVRegion) -> PoolSegment:
        """Planes kvwire did not place in a memfd, offered where they lie (exported once now: memory CUDA cannot
        share is refused at start-up, not at a consumer's first pull).

        Raises:
            ValueError: planes on a device shared memory cannot reach, or that CUDA cannot share by handle.
        """
        device = region.planes[0].device
        segment: PoolSegment
        if device.type == "cuda":
            from kvwire.connectors.transports.shm.cuda_ipc import CudaPlanes  # needs CUDA: imported only for it

            segment = CudaPlanes(self.config.node_id, self.epoch, region)
        elif device.type == "cpu":
            segment = CmaPlanes(self.config.node_id, self.epoch, region)
        else:
            raise ValueError(f"node {self.config.node_id}: shared memory cannot serve planes on {device}")
        try:
            segment.export()
        except RuntimeError as exc:  # e.g. memory from an allocator other than torch's caching one
            raise ValueError(f"node {self.config.node_id}: its KV cache cannot be shared by CUDA IPC handle ({exc}); "
                             "serve it over ucx or tcp") from exc
        return segment

    def puller(self, region: KVRegion) -> Puller:
        return SHMPuller(self.config.node_id, region, self.config.pull_lanes)

    def data_path(self, puller: Puller, loc: KVLocation) -> DataPath:
        assert isinstance(puller, SHMPuller)
        return puller.path_to(loc)

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
