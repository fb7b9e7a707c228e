"""The producer role, transport-agnostic: hold a computed prompt's KV and serve pulls of it.

A request here:

1. `publish` (after its prompt's forward) or `begin_layers` (before it, layer-wise): its
   blocks and hidden states enter the held table, the one owner of those blocks.
2. Its location goes straight to the consumer waiting for it (`KVReady` to the
   `consumer_endpoint` the sequence names), then to the directory as READY (a few
   milliseconds later when the consumer was told: ADVERTISE_DELAY_S). A READY the directory does not
   take (Redis down or restarting) is tried again every ADVERTISE_RETRY_S while the KV is held.
3. A consumer pulls it through one of the transfer servers (one per transport this
   producer serves over, sharing the held table). A pull confirmed to its consumer moves
   the entry to CONSUMED and deletes it, here, off the consumer's way to its first token.
4. The held table releases the blocks when the pull ends, when nobody will pull (the
   consumer gave up; the layer-wise forward failed), or at the hold deadline (the entry
   becomes EXPIRED). Releases happen on the transfer servers' threads: each is queued and
   the owner's `wakeup` woken; the owner's loop takes them with `released()`, on its thread.

A prompt this producer will not compute is `fail`ed: its consumer recomputes at once.
When it starts, a producer fails the READY entries its earlier incarnations left.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import zmq

from kvwire.connectors.config import LAYERWISE_KINDS, ConnectorConfig, ConnectorKind
from kvwire.connectors.control.sockets import PushSockets
from kvwire.connectors.deferred import Deferred
from kvwire.connectors.directory.batch import DirectoryBatch
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory, StaleNodeError, TransferState
from kvwire.connectors.hidden import HIDDEN_KEY, dtype_of, empty_like_descs, kv_ready_location, split_request
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.producer.held import HeldRequest, HeldTable
from kvwire.connectors.producer.incarnations import fail_earlier_incarnations
from kvwire.connectors.producer.layer_gate import LayerGate
from kvwire.connectors.producer.transfer_server import TransferServer
from kvwire.connectors.prompt import prompt_fingerprint
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.kv_checksum import layer_checksums
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.shm.hold_board import ServesHoldBoard
from kvwire.connectors.transports.transport import SendEngine, Transport
from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wakeup import Mailbox, Wakeup
from kvwire.connectors.wire import KVLocation, KVReady, PullRequest, TensorDesc, TransportOffer

log = logging.getLogger(__name__)

ADVERTISE_DELAY_S = 0.005  # a told consumer has usually pulled by then: the READY is its fallback
ADVERTISE_RETRY_S = 0.5  # a READY the directory did not take is tried again this much later, while the KV is held


class Released(NamedTuple):
    """A request whose blocks the producer no longer needs."""

    request_id: str
    block_ids: list[int]


class KVProducer:
    def __init__(self, config: ConnectorConfig, directory: KVDirectory, epoch: int, transport: Transport,
                 region: KVRegion, wakeup: Wakeup | None = None):
        """Start serving `region` over each send engine.

        Args:
            config: the node's transfer-plane settings.
            directory: where locations are published (the caller owns and closes it).
            epoch: this incarnation's epoch (fences off older ones).
            transport: makes the send engines (one per transport served over); closed with this producer.
            region: the pool's bytes (from `transport.producer_pool`, where the transport needs it there).
            wakeup: woken once a release is queued for `released()` (the owner's loop waits on its fd);
                None: the producer's own (`self.wakeup`), closed with it.
        """
        self._config = config
        self._directory = directory
        self._epoch = epoch
        self._region = region
        self._layout = region.layout
        self._released: Mailbox[Released] = Mailbox(wakeup)
        self.wakeup = self._released.wakeup
        self._held = HeldTable(self._queue_release, before_release=self._unhold)
        self._fail_earlier_incarnations()
        self._transport = transport
        engines = transport.send_engines(region)
        self._board = next((e.holds for e in engines.values() if isinstance(e, ServesHoldBoard)), None)
        self._servers = {kind: self._serve(kind, engine) for kind, engine in engines.items()}
        self._offers = [TransportOffer(k, s.side_channel, s.transport_address) for k, s in self._servers.items()]
        self._consumers = PushSockets()  # engine thread only: KVReady to decode nodes' work endpoints
        self._lock = threading.Lock()
        self._advertising: set[str] = set()  # requests whose READY is on its way to the directory
        self._delivered_early: dict[str, tuple[PullRequest, ConnectorKind, int]] = {}  # pulled before READY landed
        self._streaming: set[str] = set()  # layer-wise requests begun and not yet completed (engine thread)
        self._later = Deferred(f"kv-advertise-{config.node_id}")  # READY entries of requests told directly

    @property
    def held_requests(self) -> int:
        """Requests whose blocks are held here until pulled, refused or expired."""
        return len(self._held)

    @property
    def settling_requests(self) -> int:
        """Failed pulls whose sends may still read their blocks: held until the transport settles them."""
        return sum(server.settling for server in self._servers.values())

    def holds(self, request_id: str) -> bool:
        """Whether the request's blocks are held here (`released()` will return them)."""
        return self._held.get(request_id) is not None

    def released(self) -> list[Released]:
        """The requests whose blocks were released since the last call: the caller may reuse those blocks."""
        return self._released.take()

    def _queue_release(self, request_id: str, block_ids: list[int]) -> None:
        """The held table's release (a transfer server's thread): queued for `released()`, the owner woken."""
        self._released.put(Released(request_id, block_ids))

    def publish(self, model_input: ModelInput, hidden: torch.Tensor | IntermediateTensors) -> None:
        """Hold and announce every request of a computed prompt batch (layer-wise ones: complete them).

        A READY entry means the bytes are in place: consumers that read the pool themselves
        (shared memory, CUDA IPC) may read as soon as they see it, so a CUDA pool's writes are
        synchronized first.
        """
        plane = self._region.planes[0]
        if plane.is_cuda:
            torch.cuda.synchronize(plane.device)
        for seq, rows in zip(model_input.sequences, model_input.token_slices()):
            if seq.request_id in self._streaming:
                self._complete_layers(seq.request_id, hidden[rows])
                continue
            prompt = seq.whole_prompt()  # a tail computed on a cached prefix publishes the prefix's KV too
            if seq.start_pos and isinstance(hidden, IntermediateTensors):
                raise ValueError(f"request {seq.request_id}: a pipeline stage's tail lacks the prefix's rows")
            descs, tensors, intermediate = split_request(hidden, rows)
            blocks = self._blocks_of(seq)
            loc = self._location(seq.request_id, seq.end_pos, blocks, descs, intermediate, self._checksums(blocks),
                                 tensors, prompt=prompt_fingerprint(prompt))
            self._held.add(HeldRequest(loc, tensors, time.monotonic() + self._config.kv_deadline_s))
            self._announce(loc, seq.consumer_endpoint, tensors)
        self._wake_servers()

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, prompt: str = "") -> None:
        """Hold and announce (in the directory only) a prompt another engine computed into `block_ids`, e.g.
        vLLM's: KV only, no hidden states. Its blocks must be written (a CUDA pool is synchronized here).
        `prompt`: the fingerprint of its first `num_tokens` tokens (prompt.py; "": not known)."""
        plane = self._region.planes[0]
        if plane.is_cuda:
            torch.cuda.synchronize(plane.device)
        loc = self._location(request_id, num_tokens, list(block_ids), [], False, self._checksums(block_ids),
                             prompt=prompt)
        self._held.add(HeldRequest(loc, [], time.monotonic() + self._config.kv_deadline_s))
        self._announce(loc, "")
        self._wake_servers()

    def _wake_servers(self) -> None:
        for server in self._servers.values():
            server.wake()

    def begin_layers(self, model_input: ModelInput, hidden_size: int,
                     hidden_dtype: torch.dtype) -> Callable[[int], None]:
        """Layer-wise: hold and announce every request of a prompt batch before its forward.

        Returns:
            What the forward calls after each layer's KV is written; `publish` completes the
            requests, `abort_layers` fails them.
        """
        gates = []
        for seq in model_input.sequences:
            prompt = seq.whole_prompt()  # a cached prefix's layers are written already: they go with the rest
            desc = TensorDesc(HIDDEN_KEY, dtype_of(hidden_dtype), (1, hidden_size))  # the last row (split_request)
            gate = LayerGate(seq.request_id, self._layout.num_layers, self._region.planes[0].device)
            for server in self._servers.values():
                gate.add_waker(server.wake)
            loc = self._location(seq.request_id, seq.end_pos, self._blocks_of(seq), [desc], False, [],
                                 layerwise=True, prompt=prompt_fingerprint(prompt))
            hidden = empty_like_descs([desc], self._region.planes[0].device)
            self._held.add(HeldRequest(loc, hidden, time.monotonic() + self._config.kv_deadline_s, gate=gate))
            self._streaming.add(seq.request_id)
            self._announce(loc, seq.consumer_endpoint)
            gates.append(gate)

        def on_layer(layer: int) -> None:
            for gate in gates:
                gate.layer_done(layer)
        return on_layer

    def abort_layers(self, model_input: ModelInput, reason: str) -> None:
        """The forward of a layer-wise batch failed: stop its sends, fail it (its consumers recompute),
        release what no pull is moving (a pull in flight releases when it stops)."""
        for seq in model_input.sequences:
            self._streaming.discard(seq.request_id)
            held = self._held.get(seq.request_id)
            if held is None or held.gate is None:
                continue
            held.gate.fail(reason)
            self.fail(seq.request_id, reason, allowed_from=(TransferState.PENDING, TransferState.READY))  # READY: due
            self._held.release_if_idle(seq.request_id)

    def fail(self, request_id: str, reason: str,
             allowed_from: tuple[TransferState, ...] = (TransferState.PENDING,)) -> None:
        """A prompt this producer will not serve: FAILED in the directory, so its consumer recomputes now
        (unless it already gave up). Trouble with the directory is logged: the consumer's deadline still holds."""
        try:
            self._directory.fail(request_id, reason, producer=self._config.node_id, allowed_from=allowed_from)
        except DirectoryError as exc:
            log.warning("request %s: cannot mark failed: %s", request_id, exc)

    def close(self) -> None:
        """Write the READY entries still due, stop every transfer server (releasing what is still held), the
        sockets to consumers, the transport."""
        self._later.close()
        for server in self._servers.values():
            server.close()
        self._consumers.close()
        self._transport.close()
        self._released.close()

    # --- internals -------------------------------------------------------------------------

    def _fail_earlier_incarnations(self) -> None:
        try:
            fail_earlier_incarnations(self._directory, self._config.node_id, self._epoch)
        except DirectoryError as exc:  # not fatal: what is left expires with its TTL
            log.warning("node %s: cannot look for entries its earlier incarnations left: %s",
                        self._config.node_id, exc)

    def _serve(self, kind: ConnectorKind, engine: SendEngine) -> TransferServer:
        def trusted(consumer: str) -> bytes | None:
            return self._directory.transport_address_of(consumer, kind)

        def delivered(msg: PullRequest, nbytes: int) -> None:
            self._on_delivered(msg, kind, nbytes)

        server = TransferServer(self._config.host, self._region, self._held, engine, self._config.kv_deadline_s,
                                trusted, self._on_expired, delivered, advertise_host=self._config.advertised_host)
        server.start()
        return server

    def _complete_layers(self, request_id: str, hidden: torch.Tensor | IntermediateTensors) -> None:
        """The forward of a layer-wise request is done: its hidden states go in, its gate opens fully. One
        released meanwhile (its consumer gave up, its hold expired) stays released: never published again."""
        self._streaming.discard(request_id)
        held = self._held.get(request_id)
        if held is not None and held.gate is not None:
            assert isinstance(hidden, torch.Tensor), "layer-wise KV is published by a last pipeline stage"
            held.hidden[0].copy_(hidden[-1:])
            held.gate.complete()

    def _blocks_of(self, seq: SequenceInput) -> list[int]:
        return list(seq.block_ids[:math.ceil(seq.end_pos / self._layout.block_size)])

    def _location(self, request_id: str, num_tokens: int, blocks: list[int], descs: list[TensorDesc],
                  intermediate: bool, checksums: list[int], hidden: Sequence[torch.Tensor] = (),
                  layerwise: bool = False, prompt: str = "") -> KVLocation:
        """Where `blocks` and `hidden` (the tensors `descs` describes) are offered; shared memory: the hold word,
        and the hidden states copied into the board's area. `prompt`: the KV's prompt fingerprint (prompt.py)."""
        offers = [o for o in self._offers if o.kind in LAYERWISE_KINDS] if layerwise else self._offers
        if not offers:
            raise ValueError(f"request {request_id}: no transport serves this KV"
                             + (" (layer-wise KV is served over tcp and ucx only)" if layerwise else ""))
        first = offers[0]
        hold = None if layerwise or self._board is None else self._board.mark(hidden)
        return KVLocation(
            request_id=request_id, producer=self._config.node_id, producer_epoch=self._epoch,
            kind=self._config.kind, side_channel=first.side_channel, transport_address=first.transport_address,
            layout=self._layout, block_ids=blocks, num_tokens=num_tokens,
            hidden=descs, intermediate=intermediate, offers=offers, host=host_identity(),
            layer_checksums=checksums, layerwise=layerwise, shm_hold=hold, prompt=prompt, sub_blocks=True)

    def _unhold(self, loc: KVLocation) -> None:
        """Just before `loc`'s blocks are released: shared-memory readers from now on discard their read."""
        if loc.shm_hold is not None and self._board is not None:
            self._board.unmark(loc.shm_hold)

    def _checksums(self, blocks: list[int]) -> list[int]:
        return layer_checksums(self._region, blocks) if self._config.verify_kv else []

    def _announce(self, loc: KVLocation, consumer_endpoint: str, hidden: Sequence[torch.Tensor] = ()) -> None:
        """Tell the consumer directly, then the directory: ADVERTISE_DELAY_S later when the consumer was told
        (its pull and first token then do not share the cores with the write), at once otherwise. A pull
        delivered in between is recorded once the directory has the READY."""
        with self._lock:
            self._advertising.add(loc.request_id)
        if not consumer_endpoint:
            self._advertise_now(loc)
            return
        self._send_kv_ready(kv_ready_location(loc, hidden), consumer_endpoint)
        self._later.call_in(ADVERTISE_DELAY_S, lambda: self._advertise_now(loc))

    def _advertise_now(self, loc: KVLocation) -> None:
        rid = loc.request_id
        try:
            self._advertise(loc)
        finally:
            with self._lock:
                self._advertising.discard(rid)
                early = self._delivered_early.pop(rid, None)
        if early is not None:
            self._record_delivery(*early)

    def _send_kv_ready(self, loc: KVLocation, consumer_endpoint: str) -> None:
        """`KVReady` to the consumer's node; never blocks: a consumer not reading (or a bad endpoint) still
        learns the location from the directory."""
        try:
            self._consumers.send(consumer_endpoint, KVReady(location=loc), block=False)
        except zmq.ZMQError as exc:
            log.warning("request %s: KVReady to %s not sent: %s", loc.request_id, consumer_endpoint, exc)

    def readvertise(self) -> None:
        """The directory lost its data (Redis restarted empty; the heartbeat saw it): every request held and
        not being pulled is advertised READY again, so that its consumer, watching the directory, still pulls
        it instead of recomputing at its deadline. Heartbeat thread; the writes go on the advertising thread."""
        with self._lock:
            locations = [loc for loc in self._held.idle_locations() if loc.request_id not in self._advertising]
        for loc in locations:
            self._later.call_in(0.0, functools.partial(self._advertise, loc))
        if locations:
            log.warning("the directory lost its data: advertising the KV of %d held requests again", len(locations))

    def _advertise(self, loc: KVLocation) -> None:
        try:
            published = self._directory.publish_ready(loc) or self._advertised(loc)
        except StaleNodeError as exc:
            log.error("request %s: this incarnation is fenced off, KV not advertised: %s", loc.request_id, exc)
            published = False
        except DirectoryError as exc:
            if self._advertise_later(loc, exc):
                return
            log.error("request %s: directory unavailable, KV not advertised: %s", loc.request_id, exc)
            published = False
        if not published:
            log.info("request %s: not advertised (its consumer gave up, or see above); releasing its KV",
                     loc.request_id)
            self._held.release_if_idle(loc.request_id)

    def _advertised(self, loc: KVLocation) -> bool:
        """Whether the directory holds `loc` as READY already (an advertisement again, or a retry, found the
        earlier one's). Raises DirectoryError."""
        entry = self._directory.get(loc.request_id)
        return entry is not None and entry.state == TransferState.READY and entry.location is not None \
            and (entry.location.producer, entry.location.producer_epoch) == (loc.producer, loc.producer_epoch)

    def _advertise_later(self, loc: KVLocation, exc: DirectoryError) -> bool:
        """A READY the directory did not take (Redis down, or restarting): tried again ADVERTISE_RETRY_S later while
        the request is held and its hold deadline leaves time, so that its consumer, watching the directory,
        pulls once Redis is back instead of recomputing at its deadline. Returns whether a retry is due."""
        held = self._held.get(loc.request_id)
        if held is None or time.monotonic() + ADVERTISE_RETRY_S >= held.deadline:
            return False
        log.info("request %s: directory unavailable (%s); advertising again in %.1f s while its KV is held",
                 loc.request_id, exc, ADVERTISE_RETRY_S)
        self._later.call_in(ADVERTISE_RETRY_S, lambda: self._advertise(loc))
        return True

    def _on_delivered(self, pull: PullRequest, transport: ConnectorKind, nbytes: int) -> None:
        """A transfer server confirmed a pull to its consumer: the entry becomes CONSUMED and is deleted, and
        the consumer's transfer is counted, in one round trip made here rather than on the consumer's way to
        its first token. A consumer told directly may pull before the READY reaches the directory: the
        publishing thread then does this once it has."""
        with self._lock:
            if pull.request_id in self._advertising:
                self._delivered_early[pull.request_id] = (pull, transport, nbytes)
                return
        self._record_delivery(pull, transport, nbytes)

    def _record_delivery(self, pull: PullRequest, transport: ConnectorKind, nbytes: int) -> None:
        rid = pull.request_id
        try:
            DirectoryBatch(self._directory).transition(rid, {TransferState.READY}, TransferState.CONSUMED) \
                .delete(rid).record_transfer(pull.consumer, transport, nbytes).execute()
        except DirectoryError as exc:  # costs nothing but bookkeeping now
            log.warning("request %s: delivered to %s, but the directory could not be updated: %s",
                        rid, pull.consumer, exc)

    def _on_expired(self, request_id: str) -> None:
        """A transfer server released a held request nobody pulled before its hold deadline."""
        try:
            self._directory.transition(request_id, {TransferState.PENDING, TransferState.READY},
                                       TransferState.EXPIRED, "not pulled before the hold deadline")
        except DirectoryError as exc:
            log.warning("request %s: cannot mark expired: %s", request_id, exc)
