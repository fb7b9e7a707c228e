"""The auto transport: shared memory with peers on this host, UCX with the rest.

A producer's pool lives in a shared-memory segment (so same-host consumers can read it)
that UCX serves as well; each transport gets its own transfer server, sharing the held
table, and every published location offers both plus the producer's host identity. A
consumer publishes an address for each, and pulls over shared memory from producers on
its host and over UCX from the rest (`choose`).
"""

from __future__ import annotations

import logging

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.auto.puller import AutoPuller, preference
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.offers import narrow
from kvwire.connectors.transports.shm.transport import SHMTransport
from kvwire.connectors.transports.transport import Puller, SendEngine
from kvwire.connectors.transports.ucx.send_engine import UCXSendEngine
from kvwire.connectors.wire import KVLocation
from kvwire.observability.labels import TransportFallback

log = logging.getLogger(__name__)


class AutoTransport(SHMTransport):
    kind = ConnectorKind.AUTO
    _puller: AutoPuller | None = None

    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        """Shared memory and UCX; UCX alone (said once, at start-up) where the region cannot be shared."""
        try:
            shm = self._send_engine(region)
        except ValueError as exc:
            log.warning("%s; transport auto serves over UCX alone", exc)
            return {ConnectorKind.UCX: UCXSendEngine(region)}
        return {ConnectorKind.SHM: shm, ConnectorKind.UCX: UCXSendEngine(region)}

    def puller(self, region: KVRegion) -> Puller:
        self._puller = AutoPuller(self.config.node_id, region, self.config.pull_lanes)
        return self._puller

    def published_addresses(self, puller: Puller) -> dict[ConnectorKind, bytes]:
        assert isinstance(puller, AutoPuller)
        return puller.transport_addresses

    def data_path(self, puller: Puller, loc: KVLocation) -> DataPath:
        assert isinstance(puller, AutoPuller)
        return puller.path_to(loc)

    def choose(self, loc: KVLocation) -> KVLocation:
        return narrow(loc, self._puller.preference(loc) if self._puller is not None else preference(loc))

    def fallback(self, puller: Puller, loc: KVLocation) -> TransportFallback | None:
        assert isinstance(puller, AutoPuller)
        return puller.fallback(loc)
