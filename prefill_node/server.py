"""Prefill node main loop.

A request here:

1. A `PrefillWork` arrives on the zmq work socket (a duplicate, or a prompt that can
   never fit, is refused; an invalid one is failed, so its decode node recomputes).
2. It waits until its prompt's blocks fit in the pool, bounded by the KV deadline (after
   that the decode node recomputes anyway, so the work is failed and dropped).
3. The runner computes the prompt (with the prefix cache on, past its longest prefix whose KV is in
   blocks an earlier prompt computed: those blocks are shared, and named in turn once computed), and the
   producer publishes its KV (the prefix's too) and its last hidden row:
   `KVReady` straight to the decode node the router chose, READY in the directory (with
   --layerwise: before the forward, each layer sent as it is computed).
4. The producer's held table keeps the blocks until the decode node pulled them, refused
   them, or never came. The producer then wakes the loop (the node's wake-up fd), and the
   loop takes its releases (`released()`) and gives the blocks back to the allocator: the
   allocator and every request's state change on the loop's thread only.

On SIGTERM the node drains (node/drain.py): it computes the prompts it accepted and keeps
their KV until pulled or the hold deadline passes; work still arriving goes to another
prefill node, or, with none live, is failed so its decode node computes the prompt itself
at once. Whatever is left when the grace period ends is failed. Metrics: the pool's used /
free blocks and the pending and held queues, read at each scrape.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvwire.connectors.connector import ProducerConnector
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wakeup import Wakeup
from kvwire.engine.block_names import block_names
from kvwire.engine.runner import ModelRunner
from kvwire.engine.validation import prompt_problem
from kvwire.node.config import NodeConfig
from kvwire.node.drain import Drain
from kvwire.node.runtime import NodeLoad, NodeRuntime
from kvwire.observability.labels import Queue
from kvwire.observability.tracing import TraceContext, checked, trace_id
from kvwire.protocol.work import PrefillWork

log = logging.getLogger(__name__)

@dataclass
class _Pending:
    work: PrefillWork
    arrived: float  # time.monotonic()
    trace: TraceContext | None = None  # the client's, checked (observability/tracing.py)
    arrived_ns: int = 0  # time.time_ns(), for its span


class PrefillNode:
    def __init__(self, config: NodeConfig):
        self.rt = rt = NodeRuntime.open(config, self._load)
        self._pending: deque[_Pending] = deque()
        self._wakeup = Wakeup()
        pool = rt.transport.producer_pool(rt.layout, config.engine.num_blocks, config.engine.device)
        self._producer = KVProducer(config.connector, rt.directory, rt.epoch, rt.transport,
                                    KVRegion.from_kv_caches(pool.kv_caches).of_model(pool.layout.model),
                                    wakeup=self._wakeup)
        self._connector = ProducerConnector(0, 0, config.connector, self._producer)
        self._runner = ModelRunner(rt.model, pool, producer=self._connector)
        self._drain = Drain(rt)
        self._prefix_cache = config.engine.prefix_cache
        rt.metrics.watch_blocks(lambda: rt.allocator.num_free, rt.allocator.num_blocks)
        rt.metrics.watch_queue(Queue.PREFILL_PENDING, lambda: len(self._pending))
        rt.metrics.watch_queue(Queue.PREFILL_HELD, lambda: self._producer.held_requests)
        rt.metrics.watch_queue(Queue.PREFILL_SETTLING, lambda: self._producer.settling_requests)
        rt.warm_up(self._runner)  # before registering: no router picks a cold node
        rt.start_heartbeat(on_restored=self._producer.readvertise)

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
            if self._drain.active and ((not self._pending and not self._producer.held_requests)
                                       or self._drain.expired()):
                break
            poller.poll(self._poll_timeout_ms())
            self._wakeup.drain()
            self._free_released()
            while self.rt.work_socket.poll(0):
                work = self.rt.read_work(PrefillWork)
                if isinstance(work, PrefillWork):
                    self._accept(work)
            self._run_pending()
        self._give_up()

    def wake(self) -> None:
        self._wakeup.wake()

    @property
    def wakeup_fd(self) -> int:
        return self._wakeup.write_fd

    def close(self) -> None:
        """Leave the directory, stop serving pulls (what is still held is released), close the rest."""
        self.rt.deregister()
        self._runner.close()
        self._connector.close()
        self._drain.close()
        self.rt.close()
        self._wakeup.close()

    def _load(self) -> NodeLoad:
        return NodeLoad(len(self._pending), self._producer.held_requests, settling=self._producer.settling_requests)

    def _give_up(self) -> None:
        """The drain ended: fail prompts never computed (held KV is released as the producer closes)."""
        held = self._producer.held_requests
        if self._pending or held:
            log.warning("node %s: drain timed out with %d prompts pending, %d held", self.rt.config.node_id,
                        len(self._pending), held)
        while self._pending:
            self._producer.fail(self._pending.popleft().work.request_id, "prefill node shut down")

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
            self._producer.fail(work.request_id, reason)
            return
        trace = checked(work.trace)
        if trace is not None:
            log.info("request %s: trace %s", work.request_id, trace_id(trace))
        self._pending.append(_Pending(work, time.monotonic(), trace, time.time_ns()))

    def _known(self, rid: str) -> bool:
        return self._producer.holds(rid) or any(p.work.request_id == rid for p in self._pending)

    def _turn_away(self, work: PrefillWork) -> None:
        """Work that arrived while draining: to another prefill node, else failed so decode recomputes now."""
        if self._drain.forward(work) is not None:
            return
        self._producer.fail(work.request_id, f"prefill node {self.rt.config.node_id} is shutting down")

    def _run_pending(self) -> None:
        deadline_s = self.rt.config.connector.kv_deadline_s
        while self._pending:
            item = self._pending[0]
            if time.monotonic() - item.arrived > deadline_s:
                self._pending.popleft()
                log.warning("request %s: no free KV blocks within the deadline; dropped", item.work.request_id)
                self._producer.fail(item.work.request_id, "not computed within the KV deadline")  # recompute now
                continue
            need = math.ceil(len(item.work.prompt_token_ids) / self.rt.layout.block_size)
            if need > self.rt.allocator.num_free:
                return  # a release will wake us
            self._pending.popleft()
            error = self._prefill(item.work, need)
            self.rt.spans.record("kvwire.prefill", item.trace, item.arrived_ns, time.time_ns(), {
                "kvwire.request_id": item.work.request_id, "kvwire.node": self.rt.config.node_id,
                "kvwire.prompt_tokens": len(item.work.prompt_token_ids)}, error=error)

    def _prefill(self, work: PrefillWork, need: int) -> str:
        """Compute one prompt, on its longest cached prefix (`_blocks`); the producer holds its blocks from
        publishing on (and frees them at release: a block shared with other prompts is freed once per prompt).
        Returns why it failed ("": it did not)."""
        rid, prompt = work.request_id, work.prompt_token_ids
        names = block_names(prompt, self.rt.layout.block_size) if self._prefix_cache else []  # of its full blocks
        blocks, start = self._blocks(prompt, names, need)
        seq = SequenceInput(rid, prompt[start:], start, blocks, consumer_endpoint=work.kv_ready_endpoint,
                            prompt_ids=prompt if start else None)
        try:
            self._runner.run_prompt(ModelInput([seq]))
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the node
            log.exception("request %s: prefill failed", rid)
            self._producer.fail(rid, f"prefill failed: {exc}")
            if not self._producer.holds(rid):  # layer-wise: held already; its release frees the blocks
                self.rt.allocator.free(blocks)
            return f"prefill failed: {exc}"
        for block, name in zip(blocks, names):
            self.rt.allocator.name(block, name)  # their KV is written: later prompts may start on them
        self.rt.metrics.prompt_tokens_cached.inc(start)
        return ""

    def _blocks(self, prompt: list[int], names: list[bytes], need: int) -> tuple[list[int], int]:
        """`need` blocks for `prompt`: those of its longest cached prefix first (shared, by the `names` of its full
        blocks; never its last token's: its hidden row is computed), then fresh ones. Returns (blocks, cached
        tokens)."""
        size = self.rt.layout.block_size
        cached = self.rt.allocator.share(names[:(len(prompt) - 1) // size])
        return cached + self.rt.allocator.allocate(need - len(cached)), len(cached) * size

    def _invalid(self, work: PrefillWork) -> str:
        problem = prompt_problem(work.prompt_token_ids, self.rt.model.config.vocab_size, self.rt.max_model_len)
        if problem:
            return problem
        if math.ceil(len(work.prompt_token_ids) / self.rt.layout.block_size) > self.rt.allocator.num_blocks:
            return "prompt needs more KV blocks than the pool has"
        return ""

    def _free_released(self) -> None:
        """Free the blocks of every request the producer released since the last turn (it woke us)."""
        for released in self._producer.released():
            self.rt.allocator.free(released.block_ids)
