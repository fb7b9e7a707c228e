"""KV connector over torch.distributed: the directory protocol with 2-rank groups moving the bytes.

Each (producer, consumer) pair gets its own process group (never the global default
group), rendezvoused through a store the producer hosts and publishes as its
transport address; see `connectors.nccl.pairs`.
"""

from __future__ import annotations

from kvwire.connectors.directory_connector import DirectoryConnector
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.nccl.puller import NCCLPuller
from kvwire.connectors.nccl.send_engine import NCCLSendEngine


class NCCLConnector(DirectoryConnector):
    def _make_send_engine(self, region: KVRegion) -> NCCLSendEngine:
        return NCCLSendEngine(self.config.host, region, store_timeout_s=self.config.kv_deadline_s)

    def _make_puller(self, region: KVRegion) -> NCCLPuller:
        return NCCLPuller(self.config.node_id, self.config.host, region)
