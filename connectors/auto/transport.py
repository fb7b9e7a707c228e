"""The auto connector: a producer serves its pool over shared memory and UCX at once.

Its pool lives in a shared-memory segment (so same-host consumers can read it) that
UCX serves as well; each transport gets its own transfer server, sharing the held
table, and every published location offers both plus the producer's host identity.
A consumer pulls over shared memory from producers on its host and over UCX from the
rest, and reports which transport each transfer used.
"""

from __future__ import annotations

from kvwire.connectors.auto.puller import AutoPuller
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.shm.transport import SHMConnector
from kvwire.connectors.transfer_server import SendEngine
from kvwire.connectors.ucx.send_engine import UCXSendEngine


class AutoConnector(SHMConnector):
    def _make_send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {ConnectorKind.SHM: self._make_send_engine(region), ConnectorKind.UCX: UCXSendEngine()}

    def _make_puller(self, region: KVRegion) -> AutoPuller:
        return AutoPuller(self.config.node_id, region, self.config.pull_lanes)
