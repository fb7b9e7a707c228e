"""Decode node main loop.

A request here (its one record: `DecodeRequest`, request.py):

1. A `DecodeWork` arrives on the zmq work socket and is validated (an invalid one is
   answered with `WorkError` at once).
2. Its KV is expected (`KVConsumer.expect`): it waits in the node's `awaiting_kv` queue,
   outside the engine, so running requests keep decoding, until the consumer says the KV
   can be pulled (the prefill node's `KVReady` in the consumer's inbox, or the directory's
   READY, whichever comes first) or will never come.
3. It moves to the engine's queues: waiting until its blocks fit, then pulling (`receiving`,
   on the runner's pull thread while others decode) and running. The consumer pulls its KV
   and hidden states: if they arrive within the KV deadline the prompt's forward is
   skipped (bypassed), otherwise the prompt is recomputed here, so no request is lost to
   a failed transfer. A request with no prefill node is computed here from the start, unless it is a
   later choice of a request (`DecodeWork.prompt_of`): it then starts from that one's prompt KV, shared
   and sampled in the same step as its first token (engine/shared_prompts.py).
4. Each engine step streams the new tokens (and their logprobs, when asked) to the router
   as `TokenChunk`s; the last one carries the finish reason and the transfer statistics.
   Finished requests free their blocks at once.

At any of these states the router may send `CancelWork` (a stop string matched, the client
left): the request is dropped without a word more, its blocks freed (once its pull, if one
is writing them, ends).

On SIGTERM the node drains (node/drain.py): it finishes every request it holds, forwards
work still arriving to another decode node (or answers it `WorkError` DRAINING when there
is none), and fails whatever is left when the grace period ends. Metrics: the pool's used
/ free blocks and the three queues (awaiting KV, waiting for blocks, running) are read at
each scrape; TTFT, time per output token and recomputes are recorded as requests finish.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from kvwire.connectors.connector import ConsumerConnector
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.control.sockets import PushSockets
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wakeup import Wakeup
from kvwire.decode_node.request import DecodeRequest
from kvwire.engine.block_names import cacheable
from kvwire.engine.llm_engine import InvalidRequest, LLMEngine, StepOutput
from kvwire.engine.runner import ModelRunner
from kvwire.engine.sequence import Sequence
from kvwire.node.config import NodeConfig
from kvwire.node.drain import Drain
from kvwire.node.runtime import NodeLoad, NodeRuntime
from kvwire.observability.labels import PathReason, Queue, RecomputeReason, TransferFailure
from kvwire.observability.tracing import checked, trace_id
from kvwire.protocol.work import CancelWork, DecodeStats, DecodeWork, ErrorKind, TokenChunk, WorkError, span_attributes

log = logging.getLogger(__name__)


class DecodeNode:
    def __init__(self, config: NodeConfig):
        self.rt = rt = NodeRuntime.open(config, self._load)
        self._requests: dict[str, DecodeRequest] = {}  # every request accepted and not yet answered, by id
        self._awaiting_kv: dict[str, DecodeRequest] = {}  # of those, the ones not in the engine yet
        self._prefix_misses = 0  # prompts kept here as cached-on-decode whose blocks were not in the cache
        self._wakeup = Wakeup()  # the consumer (a request settled) and the engine (a pull ended) wake us
        self._replies = PushSockets()  # TokenChunk / WorkError to routers
        pool = KVPool.allocate(rt.layout, config.engine.num_blocks, config.engine.device)
        self._consumer = KVConsumer(config.connector, rt.directory, rt.transport,
                                    KVRegion.from_kv_caches(pool.kv_caches).of_model(pool.layout.model),
                                    wakeup=self._wakeup, inbox=True)
        rt.kv_ready_endpoint = self._consumer.kv_ready_endpoint
        self._connector = ConsumerConnector(0, 0, config.connector, self._consumer)
        runner = ModelRunner(rt.model, pool, consumer=self._connector)
        self.engine = LLMEngine(runner, rt.allocator, rt.max_model_len, rt.model.config.eos_token_id,
                                wakeup=self._wakeup, prefix_cache=config.engine.prefix_cache)
        self._drain = Drain(rt)
        m, alloc = rt.metrics, rt.allocator
        m.watch_blocks(lambda: alloc.num_free, alloc.num_blocks)
        m.watch_queue(Queue.DECODE_AWAITING_KV, self._awaiting)
        m.watch_queue(Queue.DECODE_WAITING, lambda: len(self.engine.waiting) + len(self.engine.shared))
        m.watch_queue(Queue.DECODE_RUNNING, lambda: len(self.engine.running))
        rt.warm_up(runner)  # before registering: no router picks a cold node
        rt.start_heartbeat(on_beat=self._consumer.publish_addresses)

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set (call `wake()` after setting it), then drain and return.

        Draining finishes every request held; what is left when config.drain_timeout_s
        has passed is failed (the router answers it with an error) and its blocks freed.
        """
        poller = zmq.Poller()
        poller.register(self.rt.work_socket, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        poller.register(self._consumer.inbox_socket, zmq.POLLIN)  # producers' KVReady: `ready()` reads them
        while True:
            if stop.is_set():
                self._drain.begin()
            if self._drain.active and (self._idle() or self._drain.expired()):
                break
            if not self.engine.can_step():  # a settled request or a pull ending wakes us
                self.engine.after_step(idle=True)  # and what we read just now, before we wait
                poller.poll(self._drain.remaining_ms())
                self._wakeup.drain()
            while self.rt.work_socket.poll(0):
                msg = self.rt.read_work((DecodeWork, CancelWork))
                if isinstance(msg, DecodeWork):
                    self._accept(msg)
                elif isinstance(msg, CancelWork):  # draining or not: the router no longer wants it
                    self._cancel(msg.request_id)
            self._admit(self._consumer.ready())
            if self.engine.can_step():
                self._step()
        self._give_up()

    def wake(self) -> None:
        self._wakeup.wake()

    @property
    def wakeup_fd(self) -> int:
        return self._wakeup.write_fd

    def close(self) -> None:
        """Leave the directory, stop pulling, send what is queued for routers, close the rest."""
        self.rt.deregister()
        self.engine.close()
        self._connector.close()
        self._replies.close()  # with its linger: the last chunks still reach the router as the process exits
        self._drain.close()
        self.rt.close()
        self._wakeup.close()

    def _load(self) -> NodeLoad:
        """The node's queues, for its heartbeat (read on another thread)."""
        return NodeLoad(self._awaiting() + len(self.engine.waiting) + len(self.engine.shared), len(self.engine.running),
                        *self._consumer.totals.snapshot(), self._prefix_misses)

    def _awaiting(self) -> int:
        """Requests waiting for their KV: for its location, or being pulled. Any thread."""
        return len(self._awaiting_kv) + len(self.engine.receiving)

    def _idle(self) -> bool:
        return not self._requests and not self.engine.has_unfinished()

    def _give_up(self) -> None:
        """The drain's grace period ended: fail every request still held and free its blocks."""
        node = self.rt.config.node_id
        if self._requests:
            log.warning("node %s: drain timed out with %d requests unfinished; failing them", node,
                        len(self._requests))
        for rid in list(self._requests):
            self._fail(rid, f"decode node {node} shut down before the request finished")
            self.engine.abort(rid)

    def _turn_away(self, work: DecodeWork) -> None:
        """Work that arrived while draining: to another decode node, else back to the router as DRAINING."""
        if self._drain.forward(work) is None:
            node = self.rt.config.node_id
            self._send(work.reply_to, WorkError(request_id=work.request_id, node=node, kind=ErrorKind.DRAINING,
                                                reason=f"decode node {node} is shutting down; no other is live"))

    def _accept(self, work: DecodeWork) -> None:
        if self._drain.active and not self._starts_from_here(work):  # a later choice of one here finishes with it
            self._turn_away(work)
            return
        rid = work.request_id
        try:
            self.engine.validate(rid, work.prompt_token_ids, work.sampling)
        except InvalidRequest as exc:
            self._send(work.reply_to, WorkError(request_id=rid, node=self.rt.config.node_id,
                                                reason=str(exc), kind=ErrorKind.INVALID_REQUEST))
            return
        record = self._requests[rid] = DecodeRequest(work, trace=checked(work.trace))
        if record.trace is not None:
            log.info("request %s: trace %s", rid, trace_id(record.trace))
        if not work.prefill_node:
            self.engine.add_request(rid, work.prompt_token_ids, work.sampling, receive_kv=False,
                                    prompt_of=self._shared_prompt_of(work))
            return
        record.kv = self._consumer.expect(rid, work.prefill_node, work.prefill_epoch)
        self._awaiting_kv[rid] = record

    def _shared_prompt_of(self, work: DecodeWork) -> str:
        """The request whose prompt KV `work` (a later choice) starts from: its `prompt_of` while that one's prompt is
        not done here; "" when there is none (`work` then computes the prompt, counted as PROMPT_NOT_SHARED)."""
        if not work.prompt_of:
            return ""
        if self._starts_from_here(work):
            return work.prompt_of
        leader = self._requests.get(work.prompt_of)
        if leader is None:
            why = "is not here"
        elif leader.work.prompt_token_ids != work.prompt_token_ids:
            why = "has another prompt"
        else:
            why = "is past its prompt"
        log.info("request %s: request %s, whose prompt KV it was to start from, %s; computing the prompt",
                 work.request_id, work.prompt_of, why)
        return ""

    def _starts_from_here(self, work: DecodeWork) -> bool:
        """Whether `work` is a later choice of a request here whose prompt (the same) is not done yet."""
        leader = self._requests.get(work.prompt_of) if work.prompt_of else None
        return (leader is not None and leader.work.prompt_token_ids == work.prompt_token_ids
                and (work.prompt_of in self._awaiting_kv or self.engine.prompt_pending(work.prompt_of)))

    def _cancel(self, rid: str) -> None:
        """Drop a request the router cancelled, silently: its record, its KV expectation, its engine state."""
        record = self._requests.pop(rid, None)
        if record is None:
            return  # unknown, or already answered
        self._awaiting_kv.pop(rid, None)
        self._consumer.forget(rid)
        self.engine.abort(rid)
        log.info("node %s: request %s cancelled by the router", self.rt.config.node_id, rid)

    def _admit(self, ready: list[str]) -> None:
        """Hand the engine the requests whose KV can be pulled now, or never will be (they then recompute)."""
        for rid in ready:
            record = self._awaiting_kv.pop(rid, None)
            if record is not None:
                self.engine.add_request(record.request_id, record.work.prompt_token_ids, record.work.sampling)

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
        self.engine.after_step()  # producers may release what we read a step or more ago

    def _emit(self, out: StepOutput) -> None:
        seq = out.sequence
        record = self._requests[seq.request_id]
        stats = self._stats(record, seq) if seq.finished else None
        chunk = TokenChunk(request_id=seq.request_id, token_ids=out.new_token_ids, finished=seq.finished,
                           finish_reason=str(seq.finish_reason) if seq.finished else None, stats=stats,
                           logprobs=out.new_logprobs)
        if seq.finished:
            del self._requests[seq.request_id]
        self._send(record.work.reply_to, chunk)

    def _stats(self, record: DecodeRequest, seq: Sequence) -> DecodeStats:
        self._observe(record, seq)
        got = record.kv.stats if record.kv is not None else None
        ttft = seq.metrics.ttft or 0.0
        stats = DecodeStats(
            bypassed=seq.bypassed, transport=str(got.transport) if got else "", kv_bytes=got.kv_bytes if got else 0,
            transfer_ms=got.transfer_s * 1000 if got else 0.0, ttft_ms=ttft * 1000,
            prefill_node=got.producer if got else record.work.prefill_node, decode_node=self.rt.config.node_id,
            cached_tokens=seq.num_cached_tokens, transfer_failure=self._transfer_failure(record, seq))
        self.rt.spans.record("kvwire.decode", record.trace, record.arrived_ns, time.time_ns(), {
            "kvwire.request_id": record.request_id, "kvwire.node": self.rt.config.node_id,
            "kvwire.prompt_tokens": len(record.work.prompt_token_ids), "kvwire.output_tokens": len(seq.output_ids),
            **span_attributes(stats)})
        return stats

    @staticmethod
    def _transfer_failure(record: DecodeRequest, seq: Sequence) -> TransferFailure | None:
        """Why a prompt meant to receive its KV was recomputed; None when it was not."""
        if seq.bypassed or record.kv is None or not record.kv.failure:
            return None
        return record.kv.failure_kind

    def _observe(self, record: DecodeRequest, seq: Sequence) -> None:
        """Record a finished request's TTFT, time per output token, and whether its prompt was recomputed."""
        m, t = self.rt.metrics, seq.metrics
        if t.ttft is not None:
            m.ttft_seconds.observe(t.ttft)
        if len(seq.output_ids) > 1 and t.first_token_time is not None and t.finished_time is not None:
            m.tpot_seconds.observe((t.finished_time - t.first_token_time) / (len(seq.output_ids) - 1))
        m.prompt_tokens_cached.inc(seq.num_cached_tokens)
        reason = None if seq.bypassed or seq.prompt_shared else recompute_reason(record.work, seq.num_cached_tokens,
                                                                                 self.engine.block_size)
        if reason is not None:
            m.recomputes.labels(str(reason)).inc()
        if reason == RecomputeReason.PREFIX_MISS:
            self._prefix_misses += 1  # the heartbeat reads it (kvwire status)
            log.info("request %s: kept here as cached-on-decode, holding %d prompt tokens; %d were in the prefix "
                     "cache, the rest computed again", record.work.request_id, record.work.cached_expected,
                     seq.num_cached_tokens)

    def _fail(self, rid: str, reason: str) -> None:
        record = self._requests.pop(rid, None)
        self._awaiting_kv.pop(rid, None)
        self._consumer.forget(rid)
        if record is not None:
            self.rt.spans.record("kvwire.decode", record.trace, record.arrived_ns, time.time_ns(),
                                 {"kvwire.request_id": rid, "kvwire.node": self.rt.config.node_id}, error=reason)
            self._send(record.work.reply_to, WorkError(request_id=rid, node=self.rt.config.node_id, reason=reason))

    def _send(self, endpoint: str, msg: TokenChunk | WorkError) -> None:
        self._replies.send(endpoint, msg)


_BY_DESIGN = frozenset({PathReason.SHORT_PROMPT, PathReason.CACHED_ON_DECODE, PathReason.NOT_ASKED})
_NOT_PREFILLED = {PathReason.PREFILL_SATURATED: RecomputeReason.PREFILL_SATURATED,
                  PathReason.PREFILL_OTHER_MODEL: RecomputeReason.PREFILL_OTHER_MODEL,
                  PathReason.PREFILL_OTHER_BLOCK_SIZE: RecomputeReason.PREFILL_OTHER_BLOCK_SIZE,
                  PathReason.PROMPT_SHARED: RecomputeReason.PROMPT_NOT_SHARED}


def recompute_reason(work: DecodeWork, cached_tokens: int = 0, block_size: int = 1) -> RecomputeReason | None:
    """Why a prompt computed here (`cached_tokens` of it read from the prefix cache, in blocks of `block_size`)
    should have come as KV, or from the cache; None when the router kept it here by design."""
    if work.prefill_node:
        return RecomputeReason.KV_NOT_RECEIVED
    if work.path_reason is None:  # an older router
        return RecomputeReason.NO_PREFILL_NODE
    if work.path_reason == PathReason.CACHED_ON_DECODE and cached_tokens < min(
            work.cached_expected, cacheable(len(work.prompt_token_ids), block_size)):
        return RecomputeReason.PREFIX_MISS
    if work.path_reason in _BY_DESIGN:
        return None
    return _NOT_PREFILLED.get(work.path_reason, RecomputeReason.NO_PREFILL_NODE)
