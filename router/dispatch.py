"""Sends work to nodes and routes their answers back to waiting HTTP requests.

A request here, kept in one in-flight record (router/in_flight.py) from its pick until it is forgotten:

1. `submit()` asks the placement (router/placement.py) for a live decode node and, unless the request goes
   decode-only, a prefill node (on the event loop while the shared node list is fresh: no thread); records the
   request in flight with a queue for its replies; and pushes `PrefillWork` (naming the decode node's KVReady
   inbox) and `DecodeWork` at once, with the client's trace context: decode waits for the KV while prefill
   computes. What the pick reserves weighs on later picks: the request is in flight on its prefill node
   until its first reply arrives or it is forgotten, and on its decode node until its last token.
   `submit_shared()` sends a request's later choice to its first choice's decode node instead, to start
   from that one's prompt KV.
2. The reader task (started by `start()`, with the zmq PULL socket decode nodes answer
   to) puts each `TokenChunk` / `WorkError` on the request's queue; the HTTP handler
   consumes it.
3. The watchdog checks twice a second that the decode node of every request in flight is
   still registered with the same epoch, and fails the request (503, retryable) once the
   node has been gone LEFT_GRACE_S, instead of letting it wait out its timeout. The grace
   lets a node that finished and then left deliver its last chunks: it sends them before
   it deregisters, but they can still be on their way when the watch looks.
4. `cancel()` tells the decode node to stop a request the router has its answer for (a stop
   string matched, or the client left); `forget()` drops the request; `close()` stops it all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import cast

import zmq
import zmq.asyncio

from kvwire.connectors.config import NodeRole
from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.control.sockets import PushSockets, limit_receive
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory
from kvwire.connectors.wire import NodeInfo, WireError
from kvwire.observability.labels import PathReason
from kvwire.observability.tracing import TraceContext
from kvwire.protocol.work import CancelWork, DecodeWork, ErrorKind, PrefillWork, SamplingParams, TokenChunk, WorkError
from kvwire.router.config import RoutingPolicy
from kvwire.router.in_flight import InFlight
from kvwire.router.placement import Placement, Reservation, Route

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5  # how often the watchdog reads the live decode nodes
LEFT_GRACE_S = 1.0  # a request's decode node is missing this long before the request fails


class Dispatcher:
    """Routes requests to nodes and their replies back to the waiting handler.

    Args:
        decode_only_below, routing, prefix_ttl_s, prefill_max_in_flight: the placement's (router/placement.py).
        watch_period_s: how often the watchdog reads the live decode nodes.
        left_grace_s: how long a request's decode node is missing before the request fails.
    """

    def __init__(self, directory: KVDirectory, host: str, *, decode_only_below: int = 0,
                 prefill_max_in_flight: int = 0, routing: RoutingPolicy = RoutingPolicy.PREFIX,
                 prefix_ttl_s: float = 120.0, watch_period_s: float = WATCH_PERIOD_S,
                 left_grace_s: float = LEFT_GRACE_S):  # fmt: skip
        self._directory = directory
        self._placement = Placement(directory, decode_only_below=decode_only_below,
                                    prefill_max_in_flight=prefill_max_in_flight, routing=routing,
                                    prefix_ttl_s=prefix_ttl_s)
        self._in_flight: dict[str, InFlight] = {}  # request id -> its record, from its pick until forgotten
        self._held_prefills: dict[str, tuple[NodeInfo, PrefillWork]] = {}  # submitted with hold_prefill, not sent
        self._watch_period_s, self._left_grace_s = watch_period_s, left_grace_s
        self._ctx = zmq.asyncio.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        limit_receive(self._pull)
        self.reply_to = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self._work = PushSockets(self._ctx)  # work to nodes' work endpoints
        self._tasks: list[asyncio.Task] = []
        self.rejected_messages = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_replies()), loop.create_task(self._watch_decode_nodes())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._work.close()
        self._pull.close(0)

    def live_nodes(self, role: NodeRole | None = None) -> list[NodeInfo]:
        """Live nodes of `role` (None: of every role), as the placement reads them for its picks
        (`Placement.live_nodes`: a directory read shared for a moment). Not on the event loop."""
        return self._placement.live_nodes(role)

    def pick(self, prompt: Sequence[int], disaggregate: bool = True, nodes: list[NodeInfo] | None = None,
             request_id: str = "", max_tokens: int = 0) -> Route:
        """Choose the request's nodes (`Placement.pick`). With a `request_id`, the request is in flight from now:
        the prefill node chosen counts it at once (the next pick sees it), and the decode node its prompt and
        max_tokens; the decode node is taken to hold the prompt from now (the prefix index), and what it answers
        `request_id` after it. Without one, the pick reserves nothing.

        `nodes`: the live nodes of every role (`live_nodes()`); read here when not given. `submit` reads them on a
        thread and picks on the event loop, so that a request cancelled meanwhile was never counted.

        Without a live decode node nothing can be served (503).
        """
        route, reservation = self._place(prompt, disaggregate, self.live_nodes() if nodes is None else nodes,
                                         max_tokens)
        if request_id:
            self._in_flight[request_id] = InFlight(route.decode, reservation)
        return route

    def _place(self, prompt: Sequence[int], disaggregate: bool, nodes: list[NodeInfo],
               max_tokens: int) -> tuple[Route, Reservation]:
        """The placement's pick, given what the requests in flight reserve."""
        reserved = [r.reservation for r in self._in_flight.values() if r.reservation is not None]
        return self._placement.pick(prompt, disaggregate, nodes, reserved, max_tokens)

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     disaggregate: bool = True, trace: TraceContext | None = None,
                     hold_prefill: bool = False) -> tuple[Route, asyncio.Queue]:
        """Place the request and send its work (`trace`: the context its nodes' spans join). The node list is read
        on a thread only when the shared one is stale (a few times a second at most). `hold_prefill`: the prefill
        node's work waits for `release_prefill`, so that the request's later choices reach its decode node before
        its prompt can be done there (they start from it: `submit_shared`)."""
        nodes = self._placement.fresh_nodes()
        if nodes is None:
            nodes = await asyncio.to_thread(self.live_nodes)
        # on the loop, from here to the record, nothing awaits: counted as it picks
        route, reservation = self._place(prompt_ids, disaggregate, nodes, sampling.max_tokens)
        queue: asyncio.Queue = asyncio.Queue()
        self._in_flight[request_id] = InFlight(route.decode, reservation, queue, watched=True)
        if route.prefill is not None:  # its producer tells the decode node's consumer directly (an older node: its
            kv_ready = route.decode.kv_ready_endpoint or route.decode.work_endpoint  # work socket)
            prefill = (route.prefill, PrefillWork(request_id=request_id, prompt_token_ids=prompt_ids,
                                                  kv_ready_endpoint=kv_ready, trace=trace))
            if hold_prefill:
                self._held_prefills[request_id] = prefill
            else:
                await self._push(*prefill)
        elif route.reason == PathReason.NO_PREFILL_INSTANCE:
            log.warning("request %s: no live prefill node; decode computes the prompt", request_id)
        elif route.reason == PathReason.PREFILL_OTHER_MODEL:
            log.warning("request %s: no live prefill node serves decode node %s's checkpoint (model %s); decode "
                        "computes the prompt", request_id, route.decode.node_id, route.decode.model)
        elif route.reason == PathReason.PREFILL_OTHER_BLOCK_SIZE:
            log.warning("request %s: no live prefill node keeps KV blocks of decode node %s's size (%d tokens; "
                        "give every node the same --block-size); decode computes the prompt", request_id,
                        route.decode.node_id, route.decode.block_size)
        await self._push(route.decode, DecodeWork(request_id=request_id, prompt_token_ids=prompt_ids,
                                                  sampling=sampling, reply_to=self.reply_to,
                                                  prefill_node=route.prefill.node_id if route.prefill else "",
                                                  prefill_epoch=route.prefill.epoch if route.prefill else 0,
                                                  trace=trace, path_reason=route.reason,
                                                  cached_expected=route.held))
        return route, queue

    async def submit_shared(self, request_id: str, first: str, decode: NodeInfo, prompt_ids: list[int],
                            sampling: SamplingParams, trace: TraceContext | None = None) -> tuple[Route, asyncio.Queue]:
        """Send a later choice of request `first` (submitted just before, same prompt) to `first`'s decode node
        (one that `shares_prompts`), to start from `first`'s prompt KV there: no prefill node, the prompt neither
        computed nor moved again. It reserves its own blocks beyond the prompt's."""
        route = Route(None, decode, PathReason.PROMPT_SHARED)
        queue: asyncio.Queue = asyncio.Queue()
        reservation = self._placement.shared(decode, prompt_ids, sampling.max_tokens)
        self._in_flight[request_id] = InFlight(decode, reservation, queue, watched=True)
        await self._push(decode, DecodeWork(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                                            reply_to=self.reply_to, prefill_node="", trace=trace,
                                            path_reason=route.reason, prompt_of=first))
        return route, queue

    def cancel(self, request_id: str) -> None:
        """Tell the request's decode node to stop it (no-op once cancelled or forgotten); its queue takes nothing
        more."""
        record = self._in_flight.get(request_id)
        if record is None or record.queue is None:
            return
        record.queue = None
        sock = cast(zmq.asyncio.Socket, self._work.get(record.decode.work_endpoint))
        # never waits: a node whose queue is full finishes the request on its own, and nobody reads it
        sent = cast(asyncio.Future, sock.send(pack(CancelWork(request_id=request_id)), zmq.NOBLOCK))
        sent.add_done_callback(lambda f: _log_unsent(f, request_id))

    async def release_prefill(self, request_id: str) -> None:
        """Send the prefill node the work `submit` held for the request (nothing, if none was held or the request
        was forgotten)."""
        held = self._held_prefills.pop(request_id, None)
        if held is not None:
            await self._push(*held)

    def forget(self, request_id: str) -> None:
        """Drop the request's record; what it still reserved on its decode node ends there."""
        self._held_prefills.pop(request_id, None)
        record = self._in_flight.pop(request_id, None)
        if record is not None and record.reservation is not None:
            self._placement.ended(record.reservation, finished=False)

    async def _watch_decode_nodes(self) -> None:
        while True:
            await asyncio.sleep(self._watch_period_s)
            if not any(r.watched for r in self._in_flight.values()):
                continue
            try:  # draining nodes still finish what they hold
                live = await asyncio.to_thread(self._directory.live_nodes, NodeRole.DECODE, include_draining=True)
            except DirectoryError:
                continue  # no verdict without the directory; the request timeout still applies
            self._fail_orphaned({(n.node_id, n.epoch) for n in live}, time.monotonic())

    def _fail_orphaned(self, alive: set[tuple[str, int]], now: float) -> None:
        """Fail each request whose decode node has been missing from `alive` for the left grace."""
        for rid, record in self._in_flight.items():
            if not record.watched:
                continue
            node, epoch = record.decode.node_id, record.decode.epoch
            if (node, epoch) in alive:
                record.missing_since = None
                continue
            if record.missing_since is None:
                record.missing_since = now
            if now - record.missing_since >= self._left_grace_s and record.queue is not None:
                record.watched, record.missing_since = False, None
                log.warning("request %s: decode node %s (epoch %d) left the cluster", rid, node, epoch)
                record.queue.put_nowait(WorkError(request_id=rid, node=node, kind=ErrorKind.NODE_LOST,
                                                  reason="the decode node left the cluster before finishing"))

    async def _push(self, node: NodeInfo, msg: PrefillWork | DecodeWork) -> None:
        sock = cast(zmq.asyncio.Socket, self._work.get(node.work_endpoint))  # made by the asyncio context
        await sock.send(pack(msg))

    async def _read_replies(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = unpack(data, expect=(TokenChunk, WorkError))
                assert isinstance(msg, TokenChunk | WorkError)
            except WireError as exc:
                self.rejected_messages += 1
                log.warning("reply socket: rejected message: %s", exc)
                continue
            record = self._in_flight.get(msg.request_id)
            if record is None:
                continue
            if record.reservation is not None:
                record.reservation.prefill = ""  # its decode node replied: no longer in flight on its prefill node
            if isinstance(msg, TokenChunk):
                self._answered(record, msg)
            if record.queue is not None:
                record.queue.put_nowait(msg)

    def _answered(self, record: InFlight, chunk: TokenChunk) -> None:
        """Count a request's generated tokens; once it is finished it is no longer in flight on its decode node,
        and a decode node that keeps a prefix cache holds them after its prompt."""
        reservation = record.reservation
        if reservation is None:
            return
        reservation.generated += len(chunk.token_ids)
        if chunk.finished:
            record.reservation = None
            self._placement.ended(reservation, finished=True)


def _log_unsent(sent: asyncio.Future, request_id: str) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("request %s: could not cancel it on its decode node: %s", request_id, sent.exception())
