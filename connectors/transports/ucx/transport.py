"""The UCX transport: tag messages between worker-address endpoints move the bytes."""

from __future__ import annotations

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.transport import Puller, SendEngine, Transport
from kvwire.connectors.transports.ucx.puller import UCXPuller
from kvwire.connectors.transports.ucx.send_engine import UCXSendEngine
from kvwire.connectors.wire import KVLocation


class UCXTransport(Transport):
    kind = ConnectorKind.UCX

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {self.kind: UCXSendEngine(region)}

    def puller(self, region: KVRegion) -> UCXPuller:
        return UCXPuller(self.config.node_id, region, self.config.pull_lanes)

    def data_path(self, puller: Puller, loc: KVLocation) -> DataPath:
        assert isinstance(puller, UCXPuller)
        return puller.path_to(loc)
