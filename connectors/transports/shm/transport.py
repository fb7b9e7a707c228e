"""The shared-memory transport: consumers on the producer's host read its pool themselves.

1. `producer_pool` places the producer's pool in a memfd segment named for the node and
   epoch (on CUDA: ordinary device memory, shared later by IPC handle).
2. `send_engines` serves that segment over the node's private Unix socket; `puller` maps
   producers' segments read-only and copies out of them.
3. `close()` closes the segment's descriptors; its memory goes with the last process that
   maps it, so a crash leaves nothing behind but a socket file, which the node's next
   incarnation removes.
"""

from __future__ import annotations

import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.producer.transfer_server import SendEngine
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.shm.puller import SHMPuller
from kvwire.connectors.transports.shm.segment import HostSegment, PoolSegment
from kvwire.connectors.transports.shm.send_engine import SHMSendEngine
from kvwire.connectors.transports.transport import Puller, Transport
from kvwire.connectors.wire import KVLayout


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
        if device.type == "cuda":
            from kvwire.connectors.transports.shm.cuda_ipc import (
                CudaSegment,  # needs CUDA: imported only for a CUDA pool
            )

            self._segment = CudaSegment.create(self.config.node_id, self.epoch, layout, num_blocks, device)
        elif device.type == "cpu":
            self._segment = HostSegment.create(self.config.node_id, self.epoch, layout, num_blocks)
        else:
            raise ValueError(f"node {self.config.node_id}: shared memory cannot hold a pool on {device}")
        return self._segment.pool

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {self.kind: self._send_engine(region)}

    def _send_engine(self, region: KVRegion) -> SHMSendEngine:
        if self._segment is None or not self._segment.holds(region):
            raise ValueError(f"node {self.config.node_id}: serve the pool from producer_pool; "
                             "consumers can read only that one")
        return SHMSendEngine(self.config.node_id, self.epoch, self._segment)

    def puller(self, region: KVRegion) -> Puller:
        return SHMPuller(self.config.node_id, region, self.config.pull_lanes)

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
