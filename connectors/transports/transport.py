"""A transport: one way of moving KV bytes, as the two halves the roles drive.

1. `factory.create_transport(config, epoch)` imports the transport `config.kind` names.
2. A producer's pool comes from `producer_pool` (shared memory places it where consumers
   can map it); a consumer's is an ordinary `KVPool`.
3. `send_engines(region)` builds the producer's half (one send engine per transport it
   serves over, each run by a transfer server); `puller(region)` the consumer's half.
4. Per pull, the consumer lets `choose` pick which of the producer's offers to use, and
   asks `data_path` what will carry the bytes (connectors/consumer/fast_path.py).
5. `close()` releases what the transport itself holds (a shared-memory segment); the
   roles close their send engines and puller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind
from kvwire.connectors.consumer.offers import narrow
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.data_path import DataPath

if TYPE_CHECKING:
    from kvwire.connectors.producer.transfer_server import SendEngine
    from kvwire.connectors.transports.kv_region import KVRegion
    from kvwire.connectors.wire import KVLayout, KVLocation
    from kvwire.observability.labels import TransportFallback


class Puller(Protocol):
    """A transport's consumer half."""

    @property
    def transport_address(self) -> bytes:
        """Published in the directory; producers send only there."""
        ...

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Move `loc`'s blocks into `dst_blocks` and its hidden states into `hidden`; return the bytes moved.

        Raises:
            TransferError: refused, failed, or not complete by `deadline`.
        """
        ...

    def flush(self, older_than_s: float = 0.0) -> None:
        """Send what pulls left to say (at least `older_than_s` ago) once the caller is done with them (shared
        memory: its read notes)."""
        ...

    def read_ahead(self, loc: KVLocation) -> bytes:
        """`loc`'s hidden states, if this puller can read them before the pull (shared memory: from a mapped
        producer's hold board), else b"". Only the pull's own check vouches for them."""
        ...

    def close(self) -> None: ...


class ConfirmedPulls:
    """A puller whose every pull ends confirmed and brings its hidden states along: nothing to defer or read
    ahead (tcp, ucx, nccl)."""

    def flush(self, older_than_s: float = 0.0) -> None:
        """Nothing is deferred."""

    def read_ahead(self, loc: KVLocation) -> bytes:
        """Nothing is read before the pull."""
        return b""


class Transport(ABC):
    """Builds one transport's send engines and puller for a node incarnation."""

    kind: ConnectorKind

    def __init__(self, config: ConnectorConfig, epoch: int):
        """Args:
        config: the node's transfer-plane settings.
        epoch: this node incarnation's epoch (names what it shares, e.g. its memfd).
        """
        self.config = config
        self.epoch = epoch

    def producer_pool(self, layout: KVLayout, num_blocks: int, device: str | torch.device) -> KVPool:
        """The pool a producer serves from (allocated once, before its send engines)."""
        return KVPool.allocate(layout, num_blocks, device)

    @abstractmethod
    def send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        """Every transport the producer serves its KV over, preferred first."""

    @abstractmethod
    def puller(self, region: KVRegion) -> Puller:
        """The consumer's half, moving KV into `region`."""

    def published_addresses(self, puller: Puller) -> dict[ConnectorKind, bytes]:
        """The transport addresses a consumer publishes in the directory, one per transport it pulls over."""
        return {self.kind: puller.transport_address}

    def data_path(self, puller: Puller, loc: KVLocation) -> DataPath:
        """The transports that carry `loc`'s bytes to `puller` (`loc` as `choose` narrowed it): the
        transport's own name unless it can say more (UCX: what UCX selected for that producer)."""
        return DataPath.of([str(loc.kind)])

    def choose(self, loc: KVLocation) -> KVLocation:
        """`loc` as seen through the offer this consumer pulls over (its `kind` says which).

        Raises:
            TransferError: the producer offers no transport this one speaks.
        """
        return narrow(loc, [self.kind])

    def fallback(self, puller: Puller, loc: KVLocation) -> TransportFallback | None:
        """Why `loc` (as `choose` narrowed it) goes over a slower transport than it would have taken; None: it
        does not (auto: shared memory refused by the kernel)."""
        return None

    def close(self) -> None:
        """Release what the transport itself holds."""
