"""The NCCL transport: torch.distributed point-to-point, one 2-rank group per producer/consumer pair.

Each pair's group (never the global default group) is rendezvoused through a store the
producer hosts and publishes as its transport address; see `kvwire.connectors.nccl.pairs`.
"""

from __future__ import annotations

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.nccl.puller import NCCLPuller
from kvwire.connectors.nccl.send_engine import NCCLSendEngine
from kvwire.connectors.transfer_server import SendEngine
from kvwire.connectors.transport import Transport


class NCCLTransport(Transport):
    kind = ConnectorKind.NCCL

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        return {self.kind: NCCLSendEngine(self.config.host, region, store_timeout_s=self.config.kv_deadline_s)}

    def puller(self, region: KVRegion) -> NCCLPuller:
        return NCCLPuller(self.config.node_id, self.config.host, region)
