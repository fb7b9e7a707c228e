"""The auto consumer: one puller per transport, each pull going to the one its location names.

A producer on this host is read over shared memory unless this process cannot read its memory
(the kernel refuses cross-memory attach over a vLLM CPU KV cache: another user, a ptrace policy,
a seccomp profile; CUDA cannot open its device memory here, or it lies on another GPU than ours);
that producer incarnation's pulls then go over UCX, each counted as a fallback (`fallback`), the
refusal logged once.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.shm.puller import SHMPuller
from kvwire.connectors.transports.ucx.puller import UCXPuller
from kvwire.connectors.wire import KVLocation
from kvwire.observability.labels import TransportFallback

log = logging.getLogger(__name__)

REACH_TIMEOUT_S = 5.0  # how long choosing may spend mapping a same-host producer's planes
MAX_REFUSED = 4096  # producer incarnations remembered as refusing shared memory


def preference(loc: KVLocation) -> list[ConnectorKind]:
    """Transports to try for `loc`, best first: shared memory only with a producer on this host."""
    same_host = bool(loc.host) and loc.host == host_identity()
    return [ConnectorKind.SHM, ConnectorKind.UCX] if same_host else [ConnectorKind.UCX]


class AutoPuller:
    def __init__(self, node_id: str, region: KVRegion, lanes: int = 1):
        self._shm = SHMPuller(node_id, region, lanes)
        self._pullers: dict[ConnectorKind, SHMPuller | UCXPuller] = {
            ConnectorKind.SHM: self._shm, ConnectorKind.UCX: UCXPuller(node_id, region, lanes)}
        self._refused: dict[tuple[str, int], TransportFallback] = {}  # (producer, epoch) we cannot read: why
        self._lock = threading.Lock()

    def preference(self, loc: KVLocation) -> list[ConnectorKind]:
        """`preference(loc)`, without shared memory for a producer whose memory this process cannot read (found out
        the first time a producer incarnation is chosen for: its planes are opened then), nor for blocks of another
        size where it is not read by cross-memory attach (SHMPuller.reads_sub_blocks)."""
        kinds = self._readable(loc)
        if loc.pull_block_size and ConnectorKind.SHM in kinds and not self._shm.reads_sub_blocks(loc):
            return [k for k in kinds if k != ConnectorKind.SHM]
        return kinds

    def _readable(self, loc: KVLocation) -> list[ConnectorKind]:
        kinds = preference(loc)
        if ConnectorKind.SHM not in kinds or ConnectorKind.SHM not in {o.kind for o in loc.offers}:
            return kinds
        key = (loc.producer, loc.producer_epoch)
        with self._lock:
            known = key in self._refused
        if not known:
            refusal = self._shm.refusal(loc, REACH_TIMEOUT_S)
            if refusal is None:
                return kinds
            log.warning("producer %s (epoch %d) is on this host, but %s; its KV goes over UCX "
                        "(kvwire_transport_fallbacks_total{reason=\"%s\"})", loc.producer, loc.producer_epoch,
                        refusal.reason, refusal.fallback)
            with self._lock:
                if len(self._refused) >= MAX_REFUSED:
                    self._refused.clear()
                self._refused[key] = refusal.fallback
        return [k for k in kinds if k != ConnectorKind.SHM]

    def fallback(self, loc: KVLocation) -> TransportFallback | None:
        """Why `loc` (as chosen) goes over a slower transport than shared memory; None: it does not."""
        with self._lock:
            why = self._refused.get((loc.producer, loc.producer_epoch))
        if why is None and loc.pull_block_size and ConnectorKind.SHM in preference(loc):
            why = TransportFallback.SUB_BLOCKS
        return why if loc.kind != ConnectorKind.SHM else None

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
        if loc.kind == ConnectorKind.UCX and isinstance(ucx, UCXPuller):
            return ucx.path_to(loc)
        return self._shm.path_to(loc) if loc.kind == ConnectorKind.SHM else DataPath.of([str(loc.kind)])

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
