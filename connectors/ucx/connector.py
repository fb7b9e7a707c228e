"""KV connector over UCX: the directory protocol with UCX tag messages moving the bytes."""

from __future__ import annotations

from connectors.directory_connector import DirectoryConnector
from connectors.kv_region import KVRegion
from connectors.ucx.puller import UCXPuller
from connectors.ucx.server import UCXSendEngine


class UCXConnector(DirectoryConnector):
    def _make_send_engine(self, region: KVRegion) -> UCXSendEngine:
        return UCXSendEngine()

    def _make_puller(self, region: KVRegion) -> UCXPuller:
        return UCXPuller(self.config.node_id, region, self.config.pull_lanes)
