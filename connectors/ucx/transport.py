"""The UCX transport: tag messages between worker-address endpoints move the bytes."""

from __future__ import annotations

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.transfer_server import SendEngine
from kvwire.connectors.transport import Transport
from kvwire.connectors.ucx.puller import UCXPuller
from kvwire.connectors.ucx.send_engine import UCXSendEngine


class UCXTransport(Transport):
    kind = ConnectorKind.UCX

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {self.kind: UCXSendEngine()}

    def puller(self, region: KVRegion) -> UCXPuller:
        return UCXPuller(self.config.node_id, region, self.config.pull_lanes)
