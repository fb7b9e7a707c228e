"""The consumer role, transport-agnostic: learn where a request's KV is, pull it, report what it moved.

A request here:

1. `expect(request_id, producer)`: a request whose KV a producer is computing has arrived.
   Its record (expected.py) gets the KV deadline, and the consumer's one watcher thread
   (watcher.py) waits on the directory for it, with every other expected request's.
2. The record is settled by whichever answers first: `take_kv_ready` (the producer's direct
   `KVReady`, read from the consumer's own inbox by `ready()`: inbox.py), the watcher (the
   directory's READY, or a FAILED / EXPIRED entry), or the deadline. Its id is then queued,
   once, and the owner's `wakeup` woken: the owner's loop takes it with `ready()`, on its
   own thread, and may admit the request.
3. `receive` (the runner's pull, one at a time): check the producer's layout matches ours (fit.py)
   and that a same-host producer is not reached through the network stack (fast_path.py),
   let the transport's puller move the blocks and hidden states into ours, write the
   record's `stats`. A request nobody announced is looked up in the directory right there.
   A tensor-parallel consumer rank pulls a head slice (`HeadSlice`), or declines a copy it
   reads elsewhere (one side-channel round trip: the producer releases it sooner).
   The producer, having confirmed the pull, marks the entry CONSUMED and deletes it: no
   directory write on the way to the first token.
4. Any failure marks the entry FAILED (a late producer then releases its blocks at once)
   and raises TransferError: the caller recomputes. Bytes and time of each pull, and each
   failure by reason, go to the process's metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict

import msgspec
import torch
import zmq

from kvwire.connectors.base import HiddenStates, TransferError
from kvwire.connectors.config import ConnectorConfig, ConnectorKind
from kvwire.connectors.consumer.errors import ReceiveError, failure_of
from kvwire.connectors.consumer.expected import ExpectedKV, Received
from kvwire.connectors.consumer.fast_path import FastPathGuard
from kvwire.connectors.consumer.fit import LocationFit
from kvwire.connectors.consumer.inbox import Inbox
from kvwire.connectors.consumer.producer_watch import ProducerWatch
from kvwire.connectors.consumer.totals import PullTotals
from kvwire.connectors.consumer.watcher import Watcher, settle_from
from kvwire.connectors.control.side_channel import SideChannelClient
from kvwire.connectors.deferred import Deferred
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory, TransferState
from kvwire.connectors.hidden import empty_like_descs, join_requests, tensors_from_bytes
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.prompt import prompt_fingerprint
from kvwire.connectors.transports import row_copy
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.transport import Transport
from kvwire.connectors.wakeup import Mailbox, Wakeup
from kvwire.connectors.wire import HeadSlice, KVLocation, PullRequest
from kvwire.observability.labels import TransferFailure, TransportFallback
from kvwire.observability.metrics import Metrics, process_metrics

log = logging.getLogger(__name__)

# a decode node's producer tells it directly where the KV is: its watcher first reads the directory (the
# fallback: a lost KVReady, a FAILED entry) this long after the request came, unless the KVReady came first
DIRECT_HEAD_START_S = 0.05
NOTE_AGE_S = 0.002  # a busy node tells producers of reads this old (its first tokens are out by then)
NOTE_LATEST_S = 0.05  # a caller that never calls after_step (the classic contract alone): notes go this late
EARLY_KV_READY = 1024  # KVReady messages kept for requests not expected yet (their work is still on its way)
# transports whose copies on a GPU are kvwire's kernels (row_copy.py, piece_copy.py) where Triton runs
KERNEL_COPIES = frozenset({ConnectorKind.SHM, ConnectorKind.UCX})
MAX_RECORDS = 8192  # past this, records of requests never pulled (aborted) are dropped once settled


class KVConsumer:
    def __init__(self, config: ConnectorConfig, directory: KVDirectory, transport: Transport, region: KVRegion,
                 wakeup: Wakeup | None = None, metrics: Metrics | None = None, inbox: bool = False):
        """Build the transport's puller over `region` and publish where it receives.

        Args:
            config: the node's transfer-plane settings.
            directory: where locations are looked up (the caller owns and closes it).
            transport: makes the puller, picks an offer per pull; closed with this consumer.
            region: the pool's bytes, where pulled KV lands.
            wakeup: woken once an expected request is queued for `ready()` (the owner's loop waits on its
                fd); None: the consumer's own (`self.wakeup`), closed with it.
            inbox: open an inbox (inbox.py) for producers' KVReady: the owner polls `inbox_socket` too, and
                routers are told `kv_ready_endpoint`.
        """
        self._config = config
        self._directory = directory
        self._transport = transport
        self._region = region
        self._ready: Mailbox[str] = Mailbox(wakeup)
        self.wakeup = self._ready.wakeup
        self._metrics = metrics or process_metrics()
        self.totals = PullTotals()  # for the node's heartbeat (`kvwire status`)
        self._puller = transport.puller(region)
        self._fast_path = FastPathGuard(config, lambda loc: transport.data_path(self._puller, loc))
        self._fit = LocationFit(region, config.verify_kv)
        self._inbox = Inbox(config, self._metrics) if inbox else None
        self._expected: dict[str, ExpectedKV] = {}  # announced, not yet pulled; guarded by _lock
        self._early: OrderedDict[str, tuple[float, KVLocation]] = OrderedDict()  # (when, location); guarded by _lock
        self._lock = threading.Lock()
        self._watcher = Watcher(directory, self._settled, f"{config.node_id}-{uuid.uuid4().hex[:12]}")
        self._pulling = threading.Lock()  # the puller moves one request at a time, whichever thread asks
        self._addresses_published = 0.0
        self._stepping = False  # the caller calls `flush` (after_step); until it does, a timer sends the notes
        self._late_notes: Deferred | None = None
        self._declines = SideChannelClient()  # the pulling thread's, for declined copies (HeadSlice)
        self._decline_ids = itertools.count(1 << 62)  # transfer ids apart from the puller's
        self.publish_addresses()
        self._producer_watch = ProducerWatch(directory, self._waiting, self._settled, directory.node_ttl_s)
        self._producer_watch.start()

    @property
    def kv_ready_endpoint(self) -> str:
        """Where producers push this consumer's KVReady ("": it has no inbox)."""
        return self._inbox.endpoint if self._inbox is not None else ""

    @property
    def inbox_socket(self) -> zmq.Socket | None:
        """The inbox's socket, for the owner's poller (None: no inbox): a KVReady there is read by `ready()`."""
        return self._inbox.socket if self._inbox is not None else None

    def expect(self, request_id: str, producer: str = "", producer_epoch: int = 0,
               head_start_s: float | None = None) -> ExpectedKV:
        """A request whose KV `producer` is computing has arrived; its KV deadline starts now.

        Args:
            producer_epoch: the producer's incarnation that was sent the work (0: unknown); if another
                incarnation registers, or none for a heartbeat TTL, the KV is given up at once.
            head_start_s: how long the producer's KVReady has before the directory is first read; None: the
                consumer's policy, DIRECT_HEAD_START_S with an inbox and a named producer (it is told
                directly), else 0 (read it at once).
                While a prompt is computed the consumer's node then makes no Redis round trip, which on a
                shared host would take cores from the forward; a FAILED entry is seen this much later.
        Returns:
            Its record, whose `stats` the pull fills in.
        """
        record = ExpectedKV(request_id, producer, time.monotonic() + self._config.kv_deadline_s, watched=True,
                            producer_epoch=producer_epoch)
        with self._lock:
            if len(self._expected) > MAX_RECORDS:
                self._expected = {r: e for r, e in self._expected.items() if not e.settled}
            self._expected[request_id] = record
            when, early = self._early.pop(request_id, (0.0, None))
        if early is not None and time.monotonic() - when < self._config.kv_deadline_s:
            self.take_kv_ready(early)  # the KVReady beat the work here: the pull can start now
        if head_start_s is None:
            head_start_s = DIRECT_HEAD_START_S if self._inbox is not None and producer else 0.0
        self._watcher.add(record, head_start_s)
        return record

    def take_kv_ready(self, location: KVLocation) -> bool:
        """The producer says directly where an expected request's KV is (sooner than the directory).

        Returns:
            Whether it was taken: False for a request not expected here (or from another producer than
            the one asked), or one whose KV was already located or given up on. A KVReady for a request not
            expected yet is kept (the last EARLY_KV_READY, for the KV deadline) and taken by its `expect`.
        """
        with self._lock:
            record = self._expected.get(location.request_id)
            if record is None:  # kept a while: the request's work may come next
                self._early[location.request_id] = (time.monotonic(), location)
                while len(self._early) > EARLY_KV_READY:
                    self._early.popitem(last=False)
        if record is None:
            log.info("request %s: KVReady from %s before its work; kept for it", location.request_id,
                     location.producer)
            return False
        if record.producer and record.producer != location.producer:
            log.info("request %s: KVReady from %s, not the producer asked; ignored", location.request_id,
                     location.producer)
            return False
        location = self._read_ahead(location)
        settled = record.locate(location)
        if location.inline_hidden and record.location is location:  # off the pull's way: the KVReady just came
            with contextlib.suppress(ValueError):  # a size that does not match: the pull makes its own
                record.hidden = tensors_from_bytes(location.hidden, location.inline_hidden,
                                                   self._region.planes[0].device)
        if not settled:
            return False
        self._settled(location.request_id)
        return True

    def _read_ahead(self, location: KVLocation) -> KVLocation:
        """`location` holding its hidden states when the puller can read them now (shared memory), as a KVReady
        carries small ones: they become tensors off the pull's way; the pull's check vouches for them."""
        if location.shm_hold is None or location.inline_hidden:
            return location
        ahead = self._puller.read_ahead(location)
        return msgspec.structs.replace(location, inline_hidden=ahead) if ahead else location

    def ready(self) -> list[str]:
        """The expected requests settled since the last call, each once: their KV can be pulled now, or never
        will be (the pull then fails at once and the caller recomputes). The inbox's KVReady are taken first."""
        if self._inbox is not None:
            for location in self._inbox.take():
                self.take_kv_ready(location)
        return self._ready.take()

    def _settled(self, request_id: str) -> None:
        """A record was settled (any thread): queued for `ready()`, the owner woken."""
        self._ready.put(request_id)

    def forget(self, request_id: str) -> None:
        """The node dropped the request before pulling it (aborted, failed)."""
        with self._lock:
            self._expected.pop(request_id, None)

    def receive_batch(self, model_input: ModelInput) -> tuple[HiddenStates | None, bool, ModelInput]:
        """The contract's receive for a prompt batch: every request's KV, or none (the caller recomputes)."""
        with self._pulling:
            records = [self._take(seq.request_id) for seq in model_input.sequences]
            received: list[Received] = []
            for seq, record in zip(model_input.sequences, records):
                try:
                    received.append(self.receive(seq, record))
                except TransferError as exc:
                    log.warning("%s; recomputing its prompt (kvwire_kv_transfers_failed_total{reason=\"%s\"})",
                                exc, failure_of(exc))
                    return None, False, model_input
        if not received:
            return None, False, model_input
        lengths = [seq.num_tokens for seq in model_input.sequences]
        return join_requests([r.hidden for r in received], received[0].descs, received[0].intermediate, lengths), \
            True, model_input

    @property
    def pulls_tails(self) -> bool:
        """Whether `receive` takes a prompt's tail (the blocks before it held here, in a prefix cache)."""
        return self._fit.pulls_tails

    def receive(self, seq: SequenceInput, record: ExpectedKV | None = None) -> Received:
        """Pull one request's KV into `seq.block_ids`: the whole prompt's (`seq.start_pos` 0) or, for a tail
        starting on a block boundary (`seq.prompt_ids` the whole prompt; see `pulls_tails`), its blocks only.
        A tail's hidden states are the prompt's last row.

        Args:
            record: its record, if already taken from this consumer's table.
        Raises:
            TransferError: the KV did not come; the entry is now FAILED.
        """
        first_block, tokens, prompt = 0, -1, seq.token_ids  # -1: a tail this cannot pull (refused by the fit)
        with contextlib.suppress(ValueError):  # a tail without its whole prompt
            prompt = seq.whole_prompt()
            if seq.start_pos == 0 or (seq.start_pos % self._region.layout.block_size == 0 and self.pulls_tails):
                tokens, first_block = len(prompt), seq.start_pos // self._region.layout.block_size
        received = self.receive_blocks(seq.request_id, tokens, list(seq.block_ids), record, first_block,
                                       prompt=prompt_fingerprint(prompt))
        if first_block and not received.intermediate:  # an older producer's every row: the tail wants its last
            received = dataclasses.replace(received, hidden=[t[-1:] for t in received.hidden])
        return received

    def receive_blocks(self, request_id: str, num_tokens: int, dst_blocks: list[int],
                       record: ExpectedKV | None = None, first_block: int = 0,
                       heads: HeadSlice | None = None, pick: list[int] | None = None, prompt: str = "") -> Received:
        """Pull the KV of a prompt of `num_tokens` from block `first_block` of the producer's on into
        `dst_blocks` (the consumer holds the blocks before it already, e.g. in vLLM's prefix cache);
        `heads`: only that slice of each block's KV heads (tensor parallel; 0 heads declines the copy).
        `pick` (instead of `first_block`): `dst_blocks` pairs with the producer's whole block list, which
        must be as long, and the pull moves the blocks at these positions of both (vLLM's KV cache groups).
        `prompt`: the fingerprint of the prompt's first `num_tokens` tokens (connectors/prompt.py; "": not known).

        Raises:
            TransferError: the KV did not come; the entry is now FAILED.
        """
        record = record or self._take(request_id)
        self._puller.flush(NOTE_AGE_S)  # notes earlier receives left, if their caller did not flush them
        if time.monotonic() - self._addresses_published > self._config.entry_ttl_s / 3:
            self.publish_addresses()  # they expire with entry_ttl_s: producers refuse pulls to unknown addresses
        try:
            received = self._receive(request_id, num_tokens, dst_blocks, record, first_block, heads, pick, prompt)
            self.totals.pulled()
            self._notes_due()
            return received
        except (TransferError, DirectoryError) as exc:
            self._addresses_published = 0.0  # a restarted Redis forgets our addresses: republish
            failure = failure_of(exc)
            self._metrics.kv_transfers_failed.labels(str(failure)).inc()
            self.totals.failed(failure)
            record.pull_failed(str(exc), failure)
            self._mark_failed(request_id, str(exc))
            if record.location is not None:
                self.abandon(record.location)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(request_id, "directory", str(exc)) from exc

    def flush(self, older_than_s: float = 0.0) -> None:
        """Tell producers what the receives so far read without a round trip (shared memory) at least
        `older_than_s` ago, so they release those blocks. The caller does it once the received requests' first
        tokens are well out (a node: after later steps, and whenever it goes idle); a receive also sends what
        is NOTE_AGE_S old."""
        self._stepping = True
        self._puller.flush(older_than_s)

    def _notes_due(self) -> None:
        """A caller that has never flushed (it drives the classic contract's two calls only) still releases
        what it read: its notes go NOTE_LATEST_S after the receive."""
        if self._stepping:
            return
        if self._late_notes is None:
            self._late_notes = Deferred(f"kv-notes-{self._config.node_id}")
        self._late_notes.call_in(NOTE_LATEST_S, lambda: self._puller.flush(NOTE_AGE_S))

    def close(self) -> None:
        self._declines.close()
        self.flush()
        if self._late_notes is not None:
            self._late_notes.close()
        self._producer_watch.close()
        self._watcher.close()
        self._puller.close()
        self._transport.close()
        if self._inbox is not None:
            self._inbox.close()
        self._ready.close()

    # --- where the KV is -------------------------------------------------------------------

    def _take(self, request_id: str) -> ExpectedKV:
        with self._lock:
            record = self._expected.pop(request_id, None)
        return record or ExpectedKV(request_id, "", time.monotonic() + self._config.kv_deadline_s)

    def _waiting(self) -> list[ExpectedKV]:
        with self._lock:
            return [r for r in self._expected.values() if not r.settled]

    def _settle(self, record: ExpectedKV) -> bool:
        """Wait (until the record's deadline) for the directory to say READY or terminal; returns whether that
        settled the record. Raises DirectoryError."""
        entry = self._directory.wait_for(record.request_id, {TransferState.READY}, record.deadline)
        return settle_from(record, entry)

    # --- the pull --------------------------------------------------------------------------

    def _receive(self, rid: str, num_tokens: int, dst_blocks: list[int], record: ExpectedKV,
                 first_block: int, heads: HeadSlice | None, pick: list[int] | None = None,
                 prompt: str = "") -> Received:
        if not record.settled and record.watched:
            record.wait(record.deadline - time.monotonic())
        if not record.settled:  # nobody announced it, or the watcher is late: look here
            self._settle(record)
        if record.location is None:
            raise ReceiveError(rid, record.producer or "unknown producer", record.failure, record.failure_kind)
        loc, dst = self._fit.check(rid, num_tokens, dst_blocks, first_block, record.location, heads, pick, prompt)
        loc = self._transport.choose(loc)
        if loc.heads is not None and loc.heads.num_heads == 0:
            return self._decline(loc, dst, record)
        if refusal := self._fast_path.refusal(loc):
            raise ReceiveError(rid, loc.producer, refusal, TransferFailure.SLOW_PATH)
        fallback = self._transport.fallback(self._puller, loc)
        hidden = self._hidden_for(record, loc)
        start = time.monotonic()
        nbytes = self._puller.pull(loc, dst, hidden, record.deadline)
        elapsed = time.monotonic() - start
        self._fit.verify(rid, dst, loc)
        if fallback is None and loc.kind in KERNEL_COPIES and row_copy.missing_on(self._region.planes[0].device):
            fallback = TransportFallback.NO_COPY_KERNEL
        self._metrics.observe_transfer(str(loc.kind), nbytes, elapsed)  # the producer marks the entry CONSUMED
        log.info("request %s: %d bytes from %s over %s in %.2f ms", rid, nbytes, loc.producer, loc.kind,
                 elapsed * 1e3)
        if fallback is not None:
            self._metrics.transport_fallbacks.labels(str(fallback)).inc()
        path = str(self._transport.data_path(self._puller, loc))
        record.stats = Received(hidden, loc.hidden, loc.intermediate, nbytes, elapsed, loc.producer, loc.kind,
                                fallback, path)
        return record.stats

    def _hidden_for(self, record: ExpectedKV, loc: KVLocation) -> list[torch.Tensor]:
        """Where the pull puts `loc`'s hidden states: already holding them when the KVReady carried them
        (made as it came, by `take_kv_ready`, or here if the pull started first). The shm puller's read with no
        round trip relies on it: it moves only the blocks."""
        device = self._region.planes[0].device
        if loc.inline_hidden:
            if record.hidden is not None:
                return record.hidden
            with contextlib.suppress(ValueError):  # a size that does not match: pulled like any other
                return tensors_from_bytes(loc.hidden, loc.inline_hidden, device)
        return empty_like_descs(loc.hidden, device)

    def abandon(self, loc: KVLocation) -> None:
        """Tell `loc`'s producer this rank will not pull it (refused, failed before or during the pull, or not
        needed) so it releases it now, not at its hold deadline. Best effort: its answer is not waited for (a later
        wait on that side channel skips it), and a producer that already ended the pull refuses harmlessly. The
        thread that pulls only (it owns the side channels)."""
        address = self._transport.published_addresses(self._puller).get(loc.kind, b"")
        try:
            self._declines.send(loc.side_channel, PullRequest(
                request_id=loc.request_id, transfer_id=next(self._decline_ids), consumer=self._config.node_id,
                transport_address=address, dst_block_ids=[], heads=loc.heads, abandon=True))
        except zmq.ZMQError as exc:
            log.info("request %s: could not tell %s it will not be pulled: %s", loc.request_id, loc.producer, exc)

    def _decline(self, loc: KVLocation, dst: list[int], record: ExpectedKV) -> Received:
        """Tell `loc`'s producer this rank pulls nothing of its copy (a replica read elsewhere) and take its ok."""
        address = self._transport.published_addresses(self._puller).get(loc.kind, b"")
        transfer_id = next(self._decline_ids)
        self._declines.send(loc.side_channel, PullRequest(
            request_id=loc.request_id, transfer_id=transfer_id, consumer=self._config.node_id,
            transport_address=address, dst_block_ids=dst, first_block=loc.first_block, heads=loc.heads,
            src_block_ids=loc.block_ids, block_size=loc.pull_block_size))
        try:
            self._declines.wait(loc, transfer_id, record.deadline)
        except TransferError:
            self._declines.drop(loc.side_channel)
            raise
        record.stats = Received([], loc.hidden, loc.intermediate, 0, 0.0, loc.producer, loc.kind)
        return record.stats

    def _mark_failed(self, request_id: str, reason: str) -> None:
        """Mark the entry FAILED. The caller logs the failure, once (a node per request, vLLM per peer and
        reason)."""
        log.debug("request %s: transfer failed: %s", request_id, reason)
        try:
            self._directory.fail(request_id, reason)
        except DirectoryError as exc:
            log.warning("request %s: cannot mark failed: %s", request_id, exc)

    def publish_addresses(self) -> None:
        """Tell producers where this consumer receives KV (refreshed well within its TTL)."""
        try:
            for kind, address in self._transport.published_addresses(self._puller).items():
                self._directory.publish_transport_address(self._config.node_id, kind, address)
            self._addresses_published = time.monotonic()
        except DirectoryError as exc:
            log.warning("node %s: cannot publish its transport addresses: %s", self._config.node_id, exc)
