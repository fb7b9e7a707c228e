"""Prefill node main loop.

Lifecycle of a request here: a `PrefillWork` arrives on the zmq work socket and is
marked PENDING in the directory; it waits until its prompt's blocks fit in the pool
(bounded by the KV deadline: after that the decode node recomputes anyway, so the
work is dropped); the prompt is computed and the connector publishes its KV and
hidden states READY (with --layerwise: READY before the forward, each layer sent as
it is computed), and the same location goes straight to the decode node the router
chose (`KVReady` on its work socket); the blocks stay allocated until the connector's release
callback says the decode node pulled them, refused them, or never came. On SIGTERM the
node drains (node/drain.py): it computes the prompts it accepted and keeps their KV
until pulled or the hold deadline passes; work still arriving goes to another prefill
node, or, with none live, is marked FAILED so its decode node computes the prompt
itself at once. Whatever is left when the grace period ends is failed. Metrics: the
pool's used / free blocks and the pending and held queues, read at each scrape.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvwire.connectors.directory import DirectoryError, TransferState
from kvwire.connectors.wire import KVLocation, KVReady, PrefillWork, pack
from kvwire.engine.model_input import ModelInput, SequenceInput
from kvwire.engine.validation import prompt_problem
from kvwire.engine.wakeup import Wakeup
from kvwire.node.drain import Drain
from kvwire.node.runtime import NodeLoad, NodeRuntime
from kvwire.observability.labels import Queue

log = logging.getLogger(__name__)

MAX_DECODE_PEERS = 64  # decode nodes this node keeps a KVReady socket open to


@dataclass
class _Pending:
    work: PrefillWork
    arrived: float


class PrefillNode:
    def __init__(self, rt: NodeRuntime):
        self.rt = rt
        self._pending: deque[_Pending] = deque()
        self._held_blocks: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._wakeup = Wakeup()
        self._drain = Drain(rt)
        self._notify: dict[str, str] = {}  # request id -> its decode node's work endpoint (engine thread only)
        self._pushes: dict[str, zmq.Socket] = {}
        rt.connector.set_release_callback(self._on_release)
        rt.connector.set_located_callback(self._tell_decode)
        rt.load = lambda: NodeLoad(len(self._pending), self.held_requests)
        rt.metrics.watch_blocks(lambda: rt.allocator.num_free, rt.allocator.num_blocks)
        rt.metrics.watch_queue(Queue.PREFILL_PENDING, lambda: len(self._pending))
        rt.metrics.watch_queue(Queue.PREFILL_HELD, lambda: self.held_requests)

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set (call `wake()` after setting it), then drain and return.

        Draining computes the prompts accepted and holds their KV until pulled (or until
        the hold deadline); what is left when config.drain_timeout_s has passed is failed.
        """
        poller = zmq.Poller()
        poller.register(self.rt.work_socket, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while True:
            if stop.is_set():
                self._drain.begin()
            if self._drain.active and ((not self._pending and not self.held_requests) or self._drain.expired()):
                break
            poller.poll(self._poll_timeout_ms())
            self._wakeup.drain()
            while self.rt.work_socket.poll(0):
                work = self.rt.read_work(PrefillWork)
                if work is not None:
                    self._accept(work)
            self._run_pending()
        self._give_up()

    def wake(self) -> None:
        self._wakeup.wake()

    def close(self) -> None:
        for sock in self._pushes.values():
            sock.close(0)
        self._drain.close()
        self._wakeup.close()

    def _give_up(self) -> None:
        """The drain ended: fail prompts never computed (held KV is released as the connector closes)."""
        if self._pending or self.held_requests:
            log.warning("node %s: drain timed out with %d prompts pending, %d held", self.rt.config.node_id,
                        len(self._pending), self.held_requests)
        while self._pending:
            self._mark_failed(self._pending.popleft().work.request_id, "prefill node shut down")

    @property
    def held_requests(self) -> int:
        with self._lock:
            return len(self._held_blocks)

    def _poll_timeout_ms(self) -> int | None:
        drain_ms = self._drain.remaining_ms()
        if not self._pending:
            return drain_ms
        due = self._pending[0].arrived + self.rt.config.connector.kv_deadline_s
        pending_ms = max(0, int((due - time.monotonic()) * 1000) + 1)
        return pending_ms if drain_ms is None else min(pending_ms, drain_ms)

    def _accept(self, work: PrefillWork) -> None:
        if self._drain.active:
            self._turn_away(work)
            return
        if self._known(work.request_id):  # a duplicate must not overwrite (and leak) the blocks already held
            log.warning("request %s: already pending or held here; duplicate dropped", work.request_id)
            return
        reason = self._invalid(work)  # no PENDING entry first: the directory round trip would delay every prompt
        if reason:
            log.warning("request %s: %s", work.request_id, reason)
            self._mark_failed(work.request_id, reason)
            return
        self._pending.append(_Pending(work, time.monotonic()))

    def _known(self, rid: str) -> bool:
        with self._lock:
            if rid in self._held_blocks:
                return True
        return any(p.work.request_id == rid for p in self._pending)

    def _turn_away(self, work: PrefillWork) -> None:
        """Work that arrived while draining: to another prefill node, else failed so decode recomputes now."""
        if self._drain.forward(work) is not None:
            return
        self._mark_failed(work.request_id, f"prefill node {self.rt.config.node_id} is shutting down")

    def _run_pending(self) -> None:
        deadline_s = self.rt.config.connector.kv_deadline_s
        while self._pending:
            item = self._pending[0]
            if time.monotonic() - item.arrived > deadline_s:
                self._pending.popleft()
                log.warning("request %s: no free KV blocks within the deadline; dropped", item.work.request_id)
                self._mark_failed(item.work.request_id, "not computed within the KV deadline")  # decode: recompute now
                continue
            need = math.ceil(len(item.work.prompt_token_ids) / self.rt.pool.layout.block_size)
            if need > self.rt.allocator.num_free:
                return  # a release will wake us
            self._pending.popleft()
            self._prefill(item.work, need)

    def _prefill(self, work: PrefillWork, need: int) -> None:
        rid = work.request_id
        blocks = self.rt.allocator.allocate(need)
        with self._lock:
            self._held_blocks[rid] = blocks
        self._notify[rid] = work.notify
        try:
            self.rt.runner.run_prompt(ModelInput([SequenceInput(rid, work.prompt_token_ids, 0, blocks)]))
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the node
            log.exception("request %s: prefill failed", rid)
            self._mark_failed(rid, f"prefill failed: {exc}")
            if not self.rt.connector.holds(rid):  # layer-wise: held already; its release frees the blocks
                self._on_release(rid)
        finally:
            self._notify.pop(rid, None)

    def _tell_decode(self, location: KVLocation) -> None:
        """The connector's located callback (engine thread, while publishing): `KVReady` straight to the
        decode node the router chose, so it need not wait for the directory's READY."""
        address = self._notify.get(location.request_id)
        if not address:
            return
        try:
            self._push_socket(address).send(pack(KVReady(location=location)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # not reading, or a bad endpoint: the decode node still learns from the directory
            log.warning("request %s: KVReady to %s not sent: %s", location.request_id, address, exc)

    def _push_socket(self, address: str) -> zmq.Socket:
        sock = self._pushes.get(address)
        if sock is None:
            if len(self._pushes) >= MAX_DECODE_PEERS:  # decode nodes come and go: start over rather than grow
                for old in self._pushes.values():
                    old.close(0)
                self._pushes.clear()
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            try:
                sock.connect(address)
            except zmq.ZMQError:
                sock.close(0)
                raise
            self._pushes[address] = sock
        return sock

    def _invalid(self, work: PrefillWork) -> str:
        problem = prompt_problem(work.prompt_token_ids, self.rt.model.config.vocab_size, self.rt.max_model_len)
        if problem:
            return problem
        if math.ceil(len(work.prompt_token_ids) / self.rt.pool.layout.block_size) > self.rt.allocator.num_blocks:
            return "prompt needs more KV blocks than the pool has"
        return ""

    def _mark_failed(self, rid: str, reason: str) -> None:
        """Tell the decode node waiting for `rid` to compute the prompt itself, now (unless it already gave up)."""
        try:
            self.rt.directory.create_pending(rid, self.rt.config.node_id)
            self.rt.directory.transition(rid, {TransferState.PENDING}, TransferState.FAILED, reason)
        except DirectoryError as exc:
            log.warning("request %s: cannot mark failed: %s", rid, exc)

    def _on_release(self, rid: str) -> None:
        with self._lock:
            blocks = self._held_blocks.pop(rid, None)
        if blocks is not None:
            self.rt.allocator.free(blocks)
            self.wake()
