"""The auto consumer: one puller per transport, each pull going to the one its location names."""

from __future__ import annotations

import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.shm.puller import SHMPuller
from kvwire.connectors.transports.ucx.puller import UCXPuller
from kvwire.connectors.wire import KVLocation


def preference(loc: KVLocation) -> list[ConnectorKind]:
    """Transports to try for `loc`, best first: shared memory only with a producer on this host."""
    same_host = bool(loc.host) and loc.host == host_identity()
    return [ConnectorKind.SHM, ConnectorKind.UCX] if same_host else [ConnectorKind.UCX]


class AutoPuller:
    def __init__(self, node_id: str, region: KVRegion, lanes: int = 1):
        self._pullers: dict[ConnectorKind, SHMPuller | UCXPuller] = {
            ConnectorKind.SHM: SHMPuller(node_id, region, lanes), ConnectorKind.UCX: UCXPuller(node_id, region, lanes)}

    @property
    def transport_addresses(self) -> dict[ConnectorKind, bytes]:
        """Published in the directory, one per transport."""
        return {kind: p.transport_address for kind, p in self._pullers.items()}

    @property
    def transport_address(self) -> bytes:
        return self._pullers[ConnectorKind.UCX].transport_address

    def path_to(self, loc: KVLocation) -> DataPath:
        """What moves `loc`'s bytes: kvwire's shared memory, or what UCX selected to its producer."""
        ucx = self._pullers[ConnectorKind.UCX]
        return ucx.path_to(loc) if loc.kind == ConnectorKind.UCX and isinstance(ucx, UCXPuller) else \
            DataPath.of([str(loc.kind)])

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Pull over the transport `loc` was narrowed to (AutoTransport.choose).

        Raises:
            TransferError: as that transport's puller does.
        """
        return self._pullers[loc.kind].pull(loc, dst_blocks, hidden, deadline)

    def read_ahead(self, loc: KVLocation) -> bytes:
        """Shared memory's read ahead, for a producer on this host."""
        return self._pullers[ConnectorKind.SHM].read_ahead(loc) if ConnectorKind.SHM in preference(loc) else b""

    def flush(self, older_than_s: float = 0.0) -> None:
        for puller in self._pullers.values():
            puller.flush(older_than_s)

    def close(self) -> None:
        for puller in self._pullers.values():
            puller.close()
