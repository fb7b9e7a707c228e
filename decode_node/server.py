"""Decode node main loop.

Lifecycle of a request here: a `DecodeWork` arrives on the zmq work socket and is
validated (an invalid one is answered with `WorkError` at once); it then waits,
outside the engine, until the connector says its KV is ready to pull or can no longer
come (`connector.expect`), or the prefill node's `KVReady` names its location first
(`connector.kv_located`), so running requests keep decoding meanwhile. The engine
admits it when its blocks fit, and the runner asks the connector for its KV and
hidden states: if they arrive within the KV deadline the prompt's forward is skipped
(bypassed), otherwise the prompt is recomputed here, so no request is lost to a
failed transfer. Each engine step streams the new tokens to the router as
`TokenChunk`s; the last one carries the finish reason and the transfer statistics.
Finished requests free their blocks at once. On SIGTERM the node drains (node/drain.py):
it finishes every request it holds, forwards work still arriving to another decode
node (or answers it `WorkError` DRAINING when there is none), and fails whatever is
left when the grace period ends. Metrics: the pool's used / free blocks
and the three queues (awaiting KV, waiting for blocks, running) are read at each
scrape; TTFT, time per output token and recomputes are recorded as requests finish.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from kvwire.connectors.wire import DecodeStats, DecodeWork, ErrorKind, KVLocation, KVReady, TokenChunk, WorkError, pack
from kvwire.engine.llm_engine import InvalidRequest, LLMEngine, StepOutput
from kvwire.engine.sequence import Sequence
from kvwire.engine.wakeup import Wakeup
from kvwire.node.drain import Drain
from kvwire.node.runtime import NodeLoad, NodeRuntime
from kvwire.observability.labels import Queue, RecomputeReason

log = logging.getLogger(__name__)


class DecodeNode:
    def __init__(self, rt: NodeRuntime):
        self.rt = rt
        self.engine = LLMEngine(rt.runner, rt.allocator, rt.max_model_len, rt.model.config.eos_token_id)
        self.engine.on_received = self.wake  # a pull ended on the runner's pull thread
        self._reply_to: dict[str, str] = {}
        self._prefill_node: dict[str, str] = {}
        self._replies: dict[str, zmq.Socket] = {}
        self._awaiting_kv: dict[str, DecodeWork] = {}
        self._kv_ready: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wakeup = Wakeup()
        self._drain = Drain(rt)
        self._watch()

    def _watch(self) -> None:
        """Hand the node's load to its heartbeat and its gauges (both read it from other threads)."""
        self.rt.load = lambda: NodeLoad(self._awaiting() + len(self.engine.waiting), len(self.engine.running))
        m, alloc = self.rt.metrics, self.rt.allocator
        m.watch_blocks(lambda: alloc.num_free, alloc.num_blocks)
        m.watch_queue(Queue.DECODE_AWAITING_KV, self._awaiting)
        m.watch_queue(Queue.DECODE_WAITING, lambda: len(self.engine.waiting))
        m.watch_queue(Queue.DECODE_RUNNING, lambda: len(self.engine.running))

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set (call `wake()` after setting it), then drain and return.

        Draining finishes every request held; what is left when config.drain_timeout_s
        has passed is failed (the router answers it with an error) and its blocks freed.
        """
        poller = zmq.Poller()
        poller.register(self.rt.work_socket, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while True:
            if stop.is_set():
                self._drain.begin()
            if self._drain.active and (self._idle() or self._drain.expired()):
                break
            if not self.engine.can_step() and self._kv_ready.empty():  # a pull ending wakes us
                poller.poll(self._drain.remaining_ms())
                self._wakeup.drain()
            while self.rt.work_socket.poll(0):
                msg = self.rt.read_work((DecodeWork, KVReady))
                if isinstance(msg, KVReady):
                    self._located(msg.location)
                elif msg is not None:
                    self._accept(msg)
            self._admit_ready()
            if self.engine.can_step():
                self._step()
        self._give_up()

    def wake(self) -> None:
        self._wakeup.wake()

    def close(self) -> None:
        for sock in self._replies.values():
            sock.close()  # with its linger: the last chunks still reach the router as the process exits
        self._drain.close()
        self._wakeup.close()

    def _awaiting(self) -> int:
        """Requests waiting for their KV: for the producer's word, or being pulled."""
        return len(self._awaiting_kv) + len(self.engine.receiving)

    def _idle(self) -> bool:
        return not self.engine.has_unfinished() and not self._awaiting_kv and self._kv_ready.empty()

    def _give_up(self) -> None:
        """The drain's grace period ended: fail every request still held and free its blocks."""
        node = self.rt.config.node_id
        left = [*self._awaiting_kv, *(s.request_id for s in self.engine.unfinished)]
        if left:
            log.warning("node %s: drain timed out with %d requests unfinished; failing them", node, len(left))
        for rid in left:
            self._fail(rid, f"decode node {node} shut down before the request finished")
            self.engine.abort(rid)
        self._awaiting_kv.clear()

    def _turn_away(self, work: DecodeWork) -> None:
        """Work that arrived while draining: to another decode node, else back to the router as DRAINING."""
        if self._drain.forward(work) is None:
            node = self.rt.config.node_id
            self._send(work.reply_to, WorkError(request_id=work.request_id, node=node, kind=ErrorKind.DRAINING,
                                                reason=f"decode node {node} is shutting down; no other is live"))

    def _accept(self, work: DecodeWork) -> None:
        if self._drain.active:
            self._turn_away(work)
            return
        rid = work.request_id
        try:
            self.engine.validate(rid, work.prompt_token_ids, work.sampling)
        except InvalidRequest as exc:
            self._send(work.reply_to, WorkError(request_id=rid, node=self.rt.config.node_id,
                                                reason=str(exc), kind=ErrorKind.INVALID_REQUEST))
            return
        self._reply_to[rid] = work.reply_to
        self._prefill_node[rid] = work.prefill_node
        if not work.prefill_node:
            self.engine.add_request(rid, work.prompt_token_ids, work.sampling, receive_kv=False)
            return
        self._awaiting_kv[rid] = work
        self.rt.connector.expect(rid, self._on_kv_ready)

    def _located(self, location: KVLocation) -> None:
        """The prefill node says directly where a request's KV is: admit it now rather than when the
        directory's READY reaches the watcher (which then finds it admitted)."""
        work = self._awaiting_kv.get(location.request_id)
        if work is None or work.prefill_node != location.producer:
            log.info("request %s: KVReady from %s not expected here; ignored", location.request_id, location.producer)
            return
        if self.rt.connector.kv_located(location):
            self._kv_ready.put(location.request_id)

    def _on_kv_ready(self, request_id: str) -> None:
        self._kv_ready.put(request_id)
        self.wake()

    def _admit_ready(self) -> None:
        while not self._kv_ready.empty():
            work = self._awaiting_kv.pop(self._kv_ready.get(), None)
            if work is not None:
                self.engine.add_request(work.request_id, work.prompt_token_ids, work.sampling)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests, keep the node
            log.exception("engine step failed")
            for seq in self.engine.unfinished:
                self._fail(seq.request_id, f"engine step failed: {exc}")
                self.engine.abort(seq.request_id)
            return
        for out in outputs:
            self._emit(out)

    def _emit(self, out: StepOutput) -> None:
        seq = out.sequence
        rid = seq.request_id
        stats = self._stats(out) if seq.finished else None
        chunk = TokenChunk(request_id=rid, token_ids=out.new_token_ids, finished=seq.finished,
                           finish_reason=str(seq.finish_reason) if seq.finished else None, stats=stats)
        reply_to = self._reply_to[rid] if not seq.finished else self._reply_to.pop(rid)
        if seq.finished:
            self._prefill_node.pop(rid, None)
        self._send(reply_to, chunk)

    def _stats(self, out: StepOutput) -> DecodeStats:
        seq = out.sequence
        self._observe(seq)
        got = self.rt.connector.take_transfer_stats(seq.request_id)
        ttft = seq.metrics.ttft or 0.0
        return DecodeStats(
            bypassed=seq.bypassed, transport=got.transport if got else "", kv_bytes=got.kv_bytes if got else 0,
            transfer_ms=got.transfer_s * 1000 if got else 0.0, ttft_ms=ttft * 1000,
            prefill_node=got.producer if got else self._prefill_node.get(seq.request_id, ""),
            decode_node=self.rt.config.node_id)

    def _observe(self, seq: Sequence) -> None:
        """Record a finished request's TTFT, time per output token, and whether its prompt was recomputed."""
        m, t = self.rt.metrics, seq.metrics
        if t.ttft is not None:
            m.ttft_seconds.observe(t.ttft)
        if len(seq.output_ids) > 1 and t.first_token_time is not None and t.finished_time is not None:
            m.tpot_seconds.observe((t.finished_time - t.first_token_time) / (len(seq.output_ids) - 1))
        if not seq.bypassed:
            asked = bool(self._prefill_node.get(seq.request_id))
            m.recomputes.labels(str(RecomputeReason.KV_NOT_RECEIVED if asked else RecomputeReason.NO_PREFILL_NODE)).inc()

    def _fail(self, rid: str, reason: str) -> None:
        reply_to = self._reply_to.pop(rid, None)
        self._prefill_node.pop(rid, None)
        if reply_to:
            self._send(reply_to, WorkError(request_id=rid, node=self.rt.config.node_id, reason=reason))

    def _send(self, address: str, msg) -> None:
        sock = self._replies.get(address)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 100000)
            sock.connect(address)
            self._replies[address] = sock
        sock.send(pack(msg))
