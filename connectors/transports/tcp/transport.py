"""The TCP transport: scatter/gather socket I/O straight from and into the blocks.

The producer's send engine listens for data connections on `config.host`; the consumer's
puller draws a random token and opens its connections on its first pull (see __init__.py).
"""

from __future__ import annotations

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.tcp.puller import TCPPuller
from kvwire.connectors.transports.tcp.send_engine import TCPSendEngine
from kvwire.connectors.transports.transport import SendEngine, Transport


class TCPTransport(Transport):
    kind = ConnectorKind.TCP

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {self.kind: TCPSendEngine(self.config.host, self.config.advertised_host)}

    def puller(self, region: KVRegion) -> TCPPuller:
        return TCPPuller(self.config.node_id, region)
