"""The NCCL transport: torch.distributed point-to-point, one 2-rank group per producer/consumer pair.

Each pair's group (never the global default group) is rendezvoused through a store the
producer hosts and publishes as its transport address; see `kvwire.connectors.transports.nccl.pairs`.
The store and the Gloo device bind the node's advertised host, not its bind host: Gloo
tells its peer the address it is bound to, so a wildcard cannot work there.
"""

from __future__ import annotations

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.nccl.puller import NCCLPuller
from kvwire.connectors.transports.nccl.send_engine import NCCLSendEngine
from kvwire.connectors.transports.transport import Puller, SendEngine, Transport
from kvwire.connectors.wire import KVLocation


class NCCLTransport(Transport):
    kind = ConnectorKind.NCCL

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        engine = NCCLSendEngine(self.config.advertised_host, region, store_timeout_s=self.config.kv_deadline_s)
        return {self.kind: engine}

    def puller(self, region: KVRegion) -> NCCLPuller:
        return NCCLPuller(self.config.node_id, self.config.advertised_host, region)

    def data_path(self, puller: Puller, loc: KVLocation) -> DataPath:
        assert isinstance(puller, NCCLPuller)
        return DataPath.of([str(puller.backend)])
