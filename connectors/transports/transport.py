"""The transport contract: one way of moving KV bytes, as the two halves the roles drive.

Everything a transport implements or is handed is here, so that nothing under transports/
imports the roles above it: `Transport` (what builds the halves), `Puller` (the consumer's half),
`SendEngine` (the producer's half) with the `SendJob`s it is given and the `Claims` it reports them
to (the producer's transfer server), and what a job's held KV and layer gate show a send engine
(`HeldKV`, `Gate`).

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.kv_region import KVRegion, Part, blocks_of, byte_parts, packs
from kvwire.connectors.transports.offers import narrow
from kvwire.connectors.transports.sub_blocks import pack
from kvwire.connectors.wire import PullRequest

if TYPE_CHECKING:
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


class Gate(Protocol):
    """How far a layer-wise request's prefill has got, as a send engine reads it (the producer's LayerGate)."""

    request_id: str

    def ready_layers(self) -> int:
        """Layers whose KV may be sent now."""
        ...

    @property
    def complete_and_ready(self) -> bool:
        """Every layer and the hidden states may be sent."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the prefill stopped (nothing more will come), or None."""
        ...

    def needs_polling(self) -> bool:
        """A layer is done on the device but not yet seen so: the server loop must not sleep."""
        ...


class HeldKV(Protocol):
    """A held request, as a send engine reads it (the producer's HeldRequest)."""

    @property
    def hidden(self) -> list[torch.Tensor]:
        """The request's hidden states, contiguous, sent after its blocks."""
        ...

    @property
    def gate(self) -> Gate | None:
        """Layer-wise: how much of the prefill is done; None: all of it."""
        ...


@dataclass(frozen=True)
class Refused:
    """Why a pull may not go ahead (`Claims.claim`); the request stays pullable by its real consumer."""

    reason: str


@dataclass(eq=False)
class SendJob:
    """One granted pull: move the blocks of `runs`, then the hidden tensors, to the consumer named in `msg`."""

    identity: bytes  # the consumer's zmq identity on the side channel
    msg: PullRequest
    held: HeldKV
    region: KVRegion
    runs: list[tuple[int, int]]  # (first source block, num_blocks), one per run consecutive on both sides
    deadline: float
    replied: bool = False  # the engine answered the consumer itself (shared memory, on its own socket)
    state: object = field(default=None)  # the engine's own per-job data

    def pieces(self) -> list[torch.Tensor]:
        """What to send, in the order the consumer receives it, as tensors."""
        return self.region.pieces(self.runs) + self.held.hidden

    def parts(self) -> list[Part]:
        """The same, as buffers (cheaper to build on the CPU); a layer-wise request's blocks layer by layer."""
        kv = self.region.layer_major_parts(self.runs) if self.held.gate else self.region.parts(self.runs)
        return kv + byte_parts(self.held.hidden)

    def stream_parts(self) -> list[Part]:
        """`parts()` for a byte stream: a pull of many sub-blocks of a host pool (a pull between block sizes), its
        blocks packed into one buffer first, the same bytes in the same order (sub_blocks.pack)."""
        if not packs(self.region, self.held.gate is not None):
            return self.parts()
        assert self.region.split is not None  # packs() says so
        kv = pack(self.region.planes, self.region.split, blocks_of(self.runs))
        return byte_parts([kv, *self.held.hidden])

    @property
    def layer_nbytes(self) -> int:
        """One layer's share of the blocks' bytes (a layer-wise stream's unit)."""
        return sum(n for _, n in self.runs) * self.region.block_nbytes // self.region.layout.num_layers

    @property
    def layer_pieces(self) -> int:
        """How many of `parts()` one layer is, for a layer-wise request (they come layer after layer)."""
        return len(self.region.layer_parts(self.runs, 0))

    @property
    def num_pieces(self) -> int:
        return self.region.num_parts(self.runs) + len(self.held.hidden)

    @property
    def nbytes(self) -> int:
        blocks = sum(n for _, n in self.runs)
        return blocks * self.region.block_nbytes + sum(h.numel() * h.element_size() for h in self.held.hidden)


class Claims(Protocol):
    """What a send engine is given of the producer's transfer server: the pulls' two ends."""

    def claim(self, msg: PullRequest, identity: bytes = b"") -> SendJob | Refused:
        """Let `msg` pull its request, if it may (server thread only): it is in flight until `finish`.
        Engines that take pulls on their own channel (shared memory) call it themselves."""
        ...

    def finish(self, job: SendJob, error: BaseException | None, settling: bool = False) -> None:
        """The engine is done with `job` (error None on success); `settling`: it may still read the job's pieces,
        whose blocks stay held until `settled(job)`. Thread-safe."""
        ...

    def settled(self, job: SendJob) -> None:
        """The engine no longer reads the pieces of `job`, finished or abandoned as settling. Thread-safe."""
        ...


class SendEngine(ABC):
    """A transport's producer half. Runs on the transfer server's thread unless it says otherwise."""

    transport_address: bytes = b""
    streams_layers: bool = False  # sends a layer-wise request's layers as its gate opens them
    claims: Claims

    def bind(self, claims: Claims) -> None:
        """Given once, before any job: where the engine reports each job's end (and claims pulls it takes)."""
        self.claims = claims

    def fds(self) -> list[int]:
        """File descriptors the server loop should wake on (e.g. UCX's event fd)."""
        return []

    def progress(self) -> bool:
        """Called every loop turn: advance transfers, call `claims.finish` for done ones. Returns whether
        anything moved; an engine that keeps the loop spinning (`can_block` False) while nothing does is
        napped between turns (connectors/spin.py)."""
        return False

    def can_block(self) -> bool:
        """False when progress must run again before the loop may sleep."""
        return True

    @abstractmethod
    def start(self, job: SendJob) -> None:
        """Begin the job; `claims.finish(job, error)` must follow exactly once (any thread)."""

    def abandon(self, job: SendJob) -> bool:
        """The job missed its deadline; stop touching its pieces if the transport can. Returns whether it may
        still read them: it then calls `claims.settled(job)` once it no longer does (the blocks stay held)."""
        return False

    def close(self) -> None:
        pass


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
