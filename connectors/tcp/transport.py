"""KV connector over plain TCP: the directory protocol with scatter/gather socket I/O moving the bytes.

Lifecycle: as `DirectoryConnector`; on a prefill node `register_kv_caches` starts the
transfer server with a `TCPSendEngine` (data listener on `config.host`), on a decode
node it builds a `TCPPuller` (random token, connections opened on first pull).
"""

from __future__ import annotations

from kvwire.connectors.directory_connector import DirectoryConnector
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.tcp.puller import TCPPuller
from kvwire.connectors.tcp.send_engine import TCPSendEngine


class TCPConnector(DirectoryConnector):
    def _make_send_engine(self, region: KVRegion) -> TCPSendEngine:
        return TCPSendEngine(self.config.host)

    def _make_puller(self, region: KVRegion) -> TCPPuller:
        return TCPPuller(self.config.node_id, region)
