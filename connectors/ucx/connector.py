"""KV connector over UCX: the directory protocol with UCX tag messages moving the bytes."""

from __future__ import annotations

from typing import Callable

from connectors.directory_connector import DirectoryConnector
from connectors.held import HeldTable
from connectors.kv_region import KVRegion
from connectors.ucx.puller import UCXPuller
from connectors.ucx.server import UCXTransferServer


class UCXConnector(DirectoryConnector):
    def _make_server(self, region: KVRegion, held: HeldTable, on_expired: Callable[[str], None]) -> UCXTransferServer:
        server = UCXTransferServer(self.config.host, region, held, self.config.kv_deadline_s,
                                   self.directory.get_endpoint, on_expired)
        server.start()
        return server

    def _make_puller(self, region: KVRegion) -> UCXPuller:
        return UCXPuller(self.config.node_id, region)
