"""Producer role, transport-agnostic: hold a prefilled request's KV and advertise it.

After a prefill forward, each request's blocks and hidden states enter the held
table and its location is published READY in the directory. The transport's
transfer server serves pulls; the held table releases the blocks (through the
node's callback) when a pull finishes, fails, or never comes. A pull confirmed to its
consumer moves the entry to CONSUMED and deletes it from here (`on_delivered`), so the
consumer's path to its first token makes no directory write.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from kvwire.connectors.config import LAYERWISE_KINDS, ConnectorConfig, ConnectorKind
from kvwire.connectors.directory import DirectoryError, KVDirectory, TransferState
from kvwire.connectors.directory_batch import DirectoryBatch
from kvwire.connectors.held import HeldRequest, HeldTable
from kvwire.connectors.hidden import HIDDEN_KEY, dtype_of, empty_like_descs, split_request
from kvwire.connectors.host import host_identity
from kvwire.connectors.kv_checksum import layer_checksums
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.layer_gate import LayerGate
from kvwire.connectors.transfer_server import TransferServer
from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wire import KVLocation, PullRequest, TensorDesc, TransportOffer
from kvwire.engine.model_input import ModelInput

log = logging.getLogger(__name__)


class KVProducer:
    def __init__(self, config: ConnectorConfig, directory: KVDirectory, region: KVRegion,
                 held: HeldTable, servers: dict[ConnectorKind, TransferServer], epoch: int):
        """Args:
        servers: one transfer server per transport this node serves its KV over, the
            preferred first; they share `held`, so only one of them can serve a request's pull.
        """
        self._config = config
        self._directory = directory
        self._region = region
        self._layout = region.layout
        self._held = held
        self._servers = servers
        self._offers = [TransportOffer(k, s.side_channel, s.transport_address) for k, s in servers.items()]
        self._epoch = epoch
        self.on_located: Callable[[KVLocation], None] = lambda loc: None  # e.g. tell the consumer directly
        self._lock = threading.Lock()
        self._advertising: set[str] = set()  # requests whose READY is on its way to the directory
        self._delivered_early: dict[str, tuple[PullRequest, str, int]] = {}  # pulled before that READY landed
        self._streaming: set[str] = set()  # layer-wise requests begun and not yet completed (engine thread)

    def publish(self, model_input: ModelInput, hidden: torch.Tensor | IntermediateTensors) -> None:
        """Hold and advertise every request of a computed prompt batch (layer-wise ones: complete them).

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
            if seq.start_pos != 0:
                raise ValueError(f"request {seq.request_id}: only whole prompts can be published")
            descs, tensors, intermediate = split_request(hidden, rows)
            n_blocks = math.ceil(seq.end_pos / self._layout.block_size)
            loc = self._location(seq, descs, intermediate, self._checksums(seq.block_ids[:n_blocks]))
            self._held.add(HeldRequest(loc, tensors, time.monotonic() + self._config.kv_deadline_s))
            self._announce(loc)
        for server in self._servers.values():
            server.wake()

    def begin_layers(self, model_input: ModelInput, hidden_size: int, hidden_dtype: torch.dtype) -> Callable[[int], None]:
        """Layer-wise: hold and advertise every request of a prompt batch before its forward.

        Returns what the forward calls after each layer's KV is written; `publish` completes the
        requests, `abort_layers` fails them.
        """
        gates = []
        for seq in model_input.sequences:
            if seq.start_pos != 0:
                raise ValueError(f"request {seq.request_id}: only whole prompts can stream layer by layer")
            desc = TensorDesc(HIDDEN_KEY, dtype_of(hidden_dtype), (seq.end_pos, hidden_size))
            gate = LayerGate(seq.request_id, self._layout.num_layers, self._region.planes[0].device)
            for server in self._servers.values():
                gate.add_waker(server.wake)
            loc = self._location(seq, [desc], False, [], layerwise=True)
            hidden = empty_like_descs([desc], self._region.planes[0].device)
            self._held.add(HeldRequest(loc, hidden, time.monotonic() + self._config.kv_deadline_s, gate=gate))
            self._streaming.add(seq.request_id)
            self._announce(loc)
            gates.append(gate)

        def on_layer(layer: int) -> None:
            for gate in gates:
                gate.layer_done(layer)
        return on_layer

    def abort_layers(self, model_input: ModelInput, reason: str) -> None:
        """The forward of a layer-wise batch failed: stop its sends, mark it FAILED (its consumers
        recompute), release what no pull is moving (a pull in flight releases when it stops)."""
        for seq in model_input.sequences:
            self._streaming.discard(seq.request_id)
            held = self._held.get(seq.request_id)
            if held is None or held.gate is None:
                continue
            held.gate.fail(reason)
            try:
                self._directory.transition(seq.request_id, {TransferState.READY}, TransferState.FAILED, reason[:500])
            except DirectoryError as exc:
                log.warning("request %s: cannot mark failed: %s", seq.request_id, exc)
            self._held.release_if_idle(seq.request_id)

    def _complete_layers(self, request_id: str, hidden: torch.Tensor) -> None:
        """The forward of a layer-wise request is done: its hidden states go in, its gate opens fully. One
        released meanwhile (its consumer gave up, its hold expired) stays released: never published again."""
        self._streaming.discard(request_id)
        held = self._held.get(request_id)
        if held is not None and held.gate is not None:
            held.hidden[0].copy_(hidden)
            held.gate.complete()

    def holds(self, request_id: str) -> bool:
        """Whether the request's blocks are held here (the release callback will fire for it)."""
        return self._held.get(request_id) is not None

    def _location(self, seq, descs: list[TensorDesc], intermediate: bool, checksums: list[int],
                  layerwise: bool = False) -> KVLocation:
        n_blocks = math.ceil(seq.end_pos / self._layout.block_size)
        offers = [o for o in self._offers if o.kind in LAYERWISE_KINDS] if layerwise else self._offers
        if not offers:
            raise ValueError(f"request {seq.request_id}: no transport serves this KV"
                             + (" (layer-wise KV is served over tcp and ucx only)" if layerwise else ""))
        first = offers[0]
        return KVLocation(
            request_id=seq.request_id, producer=self._config.node_id, producer_epoch=self._epoch,
            kind=self._config.kind, side_channel=first.side_channel, transport_address=first.transport_address,
            layout=self._layout, block_ids=list(seq.block_ids[:n_blocks]), num_tokens=seq.end_pos,
            hidden=descs, intermediate=intermediate, offers=offers, host=host_identity(),
            layer_checksums=checksums, layerwise=layerwise)

    def _checksums(self, blocks: list[int]) -> list[int]:
        return layer_checksums(self._region, list(blocks)) if self._config.verify_kv else []

    def on_delivered(self, pull: PullRequest, transport: str, nbytes: int) -> None:
        """Called by the server once a pull is confirmed to its consumer: the entry becomes CONSUMED and is
        deleted, and the consumer's transfer is counted, in one round trip made here rather than on the
        consumer's way to its first token. Trouble with the directory now costs nothing but bookkeeping.
        A consumer told directly may pull before the READY reaches the directory: the publishing
        thread then does this once it has."""
        with self._lock:
            if pull.request_id in self._advertising:
                self._delivered_early[pull.request_id] = (pull, transport, nbytes)
                return
        self._record_delivery(pull, transport, nbytes)

    def _record_delivery(self, pull: PullRequest, transport: str, nbytes: int) -> None:
        rid = pull.request_id
        try:
            DirectoryBatch(self._directory).transition(rid, {TransferState.READY}, TransferState.CONSUMED) \
                .delete(rid).record_transfer(pull.consumer, transport, nbytes).execute()
        except DirectoryError as exc:
            log.warning("request %s: delivered to %s, but the directory could not be updated: %s",
                        rid, pull.consumer, exc)

    def on_expired(self, request_id: str) -> None:
        """Called by the server when a held request was never pulled."""
        try:
            self._directory.transition(request_id, {TransferState.PENDING, TransferState.READY},
                                       TransferState.EXPIRED, "not pulled before the hold deadline")
        except DirectoryError as exc:
            log.warning("request %s: cannot mark expired: %s", request_id, exc)

    def _announce(self, loc: KVLocation) -> None:
        """Tell the consumer directly (the node's callback), then the directory; a pull delivered in between
        is recorded once the directory has the READY."""
        rid = loc.request_id
        with self._lock:
            self._advertising.add(rid)
        try:
            self.on_located(loc)
        except Exception:  # noqa: BLE001 - the directory still tells the consumer
            log.exception("request %s: telling the consumer directly failed", rid)
        try:
            self._advertise(loc)
        finally:
            with self._lock:
                self._advertising.discard(rid)
                early = self._delivered_early.pop(rid, None)
        if early is not None:
            self._record_delivery(*early)

    def _advertise(self, loc: KVLocation) -> None:
        try:
            published = self._directory.publish_ready(loc)
        except DirectoryError as exc:
            log.error("request %s: directory unavailable, KV not advertised: %s", loc.request_id, exc)
            published = False
        if not published:
            log.info("request %s: consumer already gave up; releasing its KV", loc.request_id)
            self._held.release_if_idle(loc.request_id)
