"""KV connector over shared memory: the directory protocol, with consumers reading the producer's pool.

Lifecycle: `__init__` (DirectoryConnector) takes this incarnation's epoch. On a prefill
node `allocate_kv_pool` places the pool in a memfd segment named for the node and
epoch (on CUDA: ordinary device memory, shared later by IPC handle); a decode node's
pool is ordinary memory. `register_kv_caches` starts the send engine (which listens on
the node's private Unix socket) or builds the puller. `close()` stops them — the socket
file is removed, every consumer connection closed — and closes the segment's
descriptors; its memory goes with the last process that maps it, so a crash leaves
nothing behind but a socket file, which the node's next incarnation removes.
"""

from __future__ import annotations

import torch

from kvwire.connectors.config import ConnectorConfig, NodeRole
from kvwire.connectors.directory_connector import DirectoryConnector
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.shm.puller import SHMPuller
from kvwire.connectors.shm.segment import HostSegment, PoolSegment
from kvwire.connectors.shm.send_engine import SHMSendEngine
from kvwire.connectors.wire import KVLayout
from kvwire.engine.kv_cache import KVPool


class SHMConnector(DirectoryConnector):
    def __init__(self, rank: int, local_rank: int, config: ConnectorConfig):
        super().__init__(rank, local_rank, config)
        self._segment: PoolSegment | None = None  # a producer's pool

    def allocate_kv_pool(self, layout: KVLayout, num_blocks: int, device: str | torch.device) -> KVPool:
        """A producer's pool goes where consumers can map it; a consumer's stays ordinary.

        Raises:
            RuntimeError: a producer's pool was already allocated.
            OSError: the memfd could not be created.
        """
        if self.config.role != NodeRole.PREFILL:
            return super().allocate_kv_pool(layout, num_blocks, device)
        if self._segment is not None:
            raise RuntimeError(f"node {self.config.node_id}: the KV pool is allocated once")
        device = torch.device(device)
        if device.type == "cuda":
            from kvwire.connectors.shm.cuda_ipc import CudaSegment

            self._segment = CudaSegment.create(self.config.node_id, self.epoch, layout, num_blocks, device)
        elif device.type == "cpu":
            self._segment = HostSegment.create(self.config.node_id, self.epoch, layout, num_blocks)
        else:
            raise ValueError(f"node {self.config.node_id}: shared memory cannot hold a pool on {device}")
        return self._segment.pool

    def _make_send_engine(self, region: KVRegion) -> SHMSendEngine:
        if self._segment is None or not self._segment.holds(region):
            raise ValueError(f"node {self.config.node_id}: register the pool from allocate_kv_pool; "
                             "consumers can read only that one")
        return SHMSendEngine(self.config.node_id, self.epoch, self._segment)

    def _make_puller(self, region: KVRegion) -> SHMPuller:
        return SHMPuller(self.config.node_id, region, self.config.pull_lanes)

    def close(self) -> None:
        super().close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
