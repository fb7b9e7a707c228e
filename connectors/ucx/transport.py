"""KV connector over UCX: the directory protocol with UCX tag messages moving the bytes."""

from __future__ import annotations

from kvwire.connectors.directory_connector import DirectoryConnector
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.ucx.puller import UCXPuller
from kvwire.connectors.ucx.send_engine import UCXSendEngine


class UCXConnector(DirectoryConnector):
    def _make_send_engine(self, region: KVRegion) -> UCXSendEngine:
        return UCXSendEngine()

    def _make_puller(self, region: KVRegion) -> UCXPuller:
        return UCXPuller(self.config.node_id, region, self.config.pull_lanes)
