"""The connector contract on top of the directory; transports supply only the byte movers.

Lifecycle: `__init__` opens the directory and takes this node incarnation's epoch;
`register_kv_caches` sees the pool and, by role, fails what earlier incarnations of
this node left READY (connectors/incarnations.py) and starts the transport's transfer
server (prefill), or builds its puller (decode); the contract's send / recv calls
then run through `KVProducer` / `KVConsumer`; `close()` stops the transport, releases
held blocks and closes the directory.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvwire.connectors.base import HiddenStates, KVConnectorBase, TransferError
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer import KVConsumer, Puller, Received
from kvwire.connectors.directory import DirectoryEntry, DirectoryError, KVDirectory, TransferState
from kvwire.connectors.held import HeldTable
from kvwire.connectors.hidden import join_requests
from kvwire.connectors.incarnations import fail_earlier_incarnations
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.producer import KVProducer
from kvwire.connectors.transfer_server import SendEngine, TransferServer
from kvwire.connectors.wire import KVLocation, PullRequest
from kvwire.engine.model_input import ModelInput

log = logging.getLogger(__name__)

WATCHERS = 128  # requests a consumer can be waiting on at once without delaying each other


class DirectoryConnector(KVConnectorBase):
    def __init__(self, rank: int, local_rank: int, config: ConnectorConfig):
        self.rank = rank
        self.local_rank = local_rank
        self.config = config
        self.directory = KVDirectory(config.redis_url, entry_ttl_s=config.entry_ttl_s)
        self.epoch = self.directory.next_epoch(config.node_id)
        self._release_cb: Callable[[str], None] = lambda rid: None
        self._located_cb: Callable[[KVLocation], None] = lambda loc: None
        self._sender: KVProducer | None = None
        self._receiver: KVConsumer | None = None
        self._servers: dict[ConnectorKind, TransferServer] = {}
        self._puller: Puller | None = None
        self._stats: dict[str, Received] = {}
        self._deadlines: dict[str, float] = {}
        self._ready: dict[str, DirectoryEntry] = {}  # READY entries the watchers saw, until recv takes them
        self._endpoint_published = 0.0
        self._watchers = ThreadPoolExecutor(max_workers=WATCHERS, thread_name_prefix="kv-watch")
        self._pulling = threading.Lock()  # a puller moves one request at a time, whichever thread asks

    # --- transport hooks -------------------------------------------------------------

    @abstractmethod
    def _make_send_engine(self, region: KVRegion) -> SendEngine:
        """The transport's producer half, run by the transfer server."""

    def _make_send_engines(self, region: KVRegion) -> dict[ConnectorKind, SendEngine]:
        """Every transport this producer serves over, preferred first (one by default)."""
        return {self.config.kind: self._make_send_engine(region)}

    @abstractmethod
    def _make_puller(self, region: KVRegion) -> Puller:
        """Build the consumer-side puller."""

    # --- contract --------------------------------------------------------------------

    def set_release_callback(self, callback: Callable[[str], None]) -> None:
        self._release_cb = callback

    def set_located_callback(self, callback: Callable[[KVLocation], None]) -> None:
        self._located_cb = callback
        if self._sender is not None:
            self._sender.on_located = callback

    def kv_located(self, location: KVLocation) -> bool:
        rid = location.request_id
        if self._receiver is None or rid not in self._deadlines:
            return False  # not expected here (or already received)
        self._ready[rid] = DirectoryEntry(rid, TransferState.READY, location.producer, location, "")
        return True

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        region = KVRegion.from_kv_caches(kv_caches)
        if self.config.role == NodeRole.PREFILL:
            self._fail_earlier_incarnations()
            held = HeldTable(lambda rid: self._release_cb(rid))
            self._servers = {kind: self._serve(kind, engine, region, held)
                             for kind, engine in self._make_send_engines(region).items()}
            self._sender = KVProducer(self.config, self.directory, region, held, self._servers, self.epoch)
            self._sender.on_located = self._located_cb
        else:
            self._puller = self._make_puller(region)
            self._publish_endpoint()
            self._receiver = KVConsumer(self.config, self.directory, region, self._puller, kv_caches[0].device)

    def _fail_earlier_incarnations(self) -> None:
        try:
            fail_earlier_incarnations(self.directory, self.config.node_id, self.epoch)
        except DirectoryError as exc:  # not fatal: what is left expires with its TTL
            log.warning("node %s: cannot look for entries its earlier incarnations left: %s", self.config.node_id,
                        exc)

    def _serve(self, kind: ConnectorKind, engine: SendEngine, region: KVRegion, held: HeldTable) -> TransferServer:
        def trusted(consumer: str) -> bytes | None:
            return self.directory.transport_address_of(consumer, str(kind))

        def delivered(msg: PullRequest, nbytes: int) -> None:
            if self._sender is not None:
                self._sender.on_delivered(msg, str(kind), nbytes)

        server = TransferServer(self.config.host, region, held, engine, self.config.kv_deadline_s, trusted,
                                self._on_expired, delivered)
        server.start()
        return server

    def _on_expired(self, request_id: str) -> None:
        if self._sender is not None:
            self._sender.on_expired(request_id)

    def expect(self, request_id: str, on_ready: Callable[[str], None]) -> None:
        deadline = time.monotonic() + self.config.kv_deadline_s
        self._deadlines[request_id] = deadline
        self._watchers.submit(self._watch, request_id, deadline, on_ready)

    def _watch(self, request_id: str, deadline: float, on_ready: Callable[[str], None]) -> None:
        try:
            entry = self.directory.wait_for(request_id, {TransferState.READY}, deadline)
            if entry is not None and entry.state == TransferState.READY and request_id in self._deadlines:
                if len(self._ready) > 64 * WATCHERS:  # requests aborted before recv: only a shortcut is lost
                    self._ready.clear()
                self._ready[request_id] = entry  # recv starts from it: one directory round trip less
        except Exception as exc:  # noqa: BLE001 - recv will retry and decide
            log.warning("request %s: watching the directory failed: %s", request_id, exc)
        on_ready(request_id)

    def send_kv_caches_and_hidden_states(self, model_executable, model_input: ModelInput,
                                         kv_caches: list[torch.Tensor], hidden_or_intermediate_states: HiddenStates) -> None:
        if self._sender is None:
            raise RuntimeError(f"node {self.config.node_id} is not a producer, or register_kv_caches was not called")
        self._sender.publish(model_input, hidden_or_intermediate_states)

    def begin_layer_stream(self, model_input: ModelInput, hidden_size: int,
                           hidden_dtype: torch.dtype) -> Callable[[int], None] | None:
        if not self.config.layerwise or self._sender is None:
            return None
        return self._sender.begin_layers(model_input, hidden_size, hidden_dtype)

    def abort_layer_stream(self, model_input: ModelInput, reason: str) -> None:
        if self._sender is not None:
            self._sender.abort_layers(model_input, reason)

    def holds(self, request_id: str) -> bool:
        return self._sender is not None and self._sender.holds(request_id)

    def recv_kv_caches_and_hidden_states(self, model_executable, model_input: ModelInput,
                                         kv_caches: list[torch.Tensor]) -> tuple[HiddenStates | None, bool, ModelInput]:
        if self._receiver is None:
            raise RuntimeError(f"node {self.config.node_id} is not a consumer, or register_kv_caches was not called")
        if time.monotonic() - self._endpoint_published > self.config.entry_ttl_s / 3:
            self._publish_endpoint()
        with self._pulling:
            return self._recv(model_input)

    def _recv(self, model_input: ModelInput) -> tuple[HiddenStates | None, bool, ModelInput]:
        default_deadline = time.monotonic() + self.config.kv_deadline_s
        deadlines = {s.request_id: self._deadlines.pop(s.request_id, default_deadline) for s in model_input.sequences}
        received: list[Received] = []
        for seq in model_input.sequences:
            try:
                got = self._receiver.receive(seq, deadlines[seq.request_id], self._ready.pop(seq.request_id, None))
            except TransferError as exc:
                log.warning("%s", exc)
                self._stats.pop(seq.request_id, None)
                self._endpoint_published = 0.0  # a restarted Redis forgets our endpoint: republish at the next pull
                return None, False, model_input
            self._stats[seq.request_id] = got
            received.append(got)
        if not received:
            return None, False, model_input
        hidden = join_requests([r.hidden for r in received], received[0].descs, received[0].intermediate)
        return hidden, True, model_input

    def _publish_endpoint(self) -> None:
        """Tell producers where this consumer receives KV (refreshed well within its TTL)."""
        addresses = getattr(self._puller, "transport_addresses", None) or {self.config.kind: self._puller.transport_address}
        try:
            for kind, address in addresses.items():
                self.directory.publish_transport_address(self.config.node_id, str(kind), address)
            self._endpoint_published = time.monotonic()
        except DirectoryError as exc:
            log.warning("node %s: cannot publish its transport endpoint: %s", self.config.node_id, exc)

    def take_transfer_stats(self, request_id: str) -> Received | None:
        """Consumer: what the last successful pull of this request moved, once."""
        return self._stats.pop(request_id, None)

    def close(self) -> None:
        self._watchers.shutdown(wait=False, cancel_futures=True)
        for server in self._servers.values():
            server.close()
        if self._puller is not None:
            self._puller.close()
        self.directory.close()
