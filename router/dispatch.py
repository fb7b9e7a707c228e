"""Sends work to nodes and routes their answers back to waiting HTTP requests.

A request here:

1. `submit()` picks a live prefill and decode node from the directory, registers a queue
   for the request, and pushes `PrefillWork` (naming the decode node's work endpoint) and
   `DecodeWork` at once: decode waits for the KV while prefill computes.
   - The decode node is the one of the least cost in KV blocks: the prompt's blocks it does not hold
     in its prefix cache (predicted, router/prefix_index.py: what it was sent, and what it answered,
     which a conversation's next prompt starts with) plus its load: the blocks in use there by its last
     heartbeat, less those of this router's requests that ended there since, plus those of its requests
     picked for it since (each reserves its prompt and max_tokens); ties in turn. A later turn goes
     where its conversation's KV is unless that node is busier than computing the prompt elsewhere
     costs. With `RoutingPolicy.LOAD`, or no decode node keeping a prefix cache, the load alone decides.
   - The request goes decode-only (the decode node computes the prompt, no prefill node) when the
     client asked so, when the part of its prompt that node does not hold is shorter than
     `decode_only_below` tokens (a short prompt, or a cached one), when no prefill node is live, or
     when every live prefill node has `prefill_max_in_flight` requests of this router in flight (a
     request is in flight on its prefill node until its first reply arrives or it is forgotten).
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
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import zmq
import zmq.asyncio

from kvwire.connectors.config import NodeRole
from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.control.sockets import PushSockets, limit_receive
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory
from kvwire.connectors.wire import NodeInfo, WireError
from kvwire.observability.labels import PathReason, ProxyPath
from kvwire.protocol.work import CancelWork, DecodeWork, ErrorKind, PrefillWork, SamplingParams, TokenChunk, WorkError
from kvwire.router.config import RoutingPolicy
from kvwire.router.prefix_index import PrefixIndex
from kvwire.router.schemas import APIError

log = logging.getLogger(__name__)

NODES_FRESH_S = 0.25  # picks reuse the directory's node list this long (heartbeats refresh it every few seconds)
WATCH_PERIOD_S = 0.5  # how often the watchdog reads the live decode nodes
ENDED_KEEP_S = 30.0  # requests that ended are remembered this long, to correct heartbeats older than their end
LEFT_GRACE_S = 1.0  # a request's decode node is missing this long before the request fails


class Decoding(NamedTuple):
    """A request of this router in flight on a decode node, from its pick until its last token (or forgotten)."""

    node: str  # its decode node's incarnation (`_key`)
    prompt: list[int]
    generated: int  # tokens answered so far
    predicted: bool  # the prefix index predicts that node's cache: what it answers is held there after
    blocks: int  # what it reserves there: its prompt and max_tokens, in the node's blocks (0: size unknown)
    started: float  # wall-clock time of the pick, to compare with the node's heartbeats


class Ended(NamedTuple):
    started: float
    ended: float
    blocks: int


@dataclass(frozen=True)
class Route:
    prefill: NodeInfo | None  # None: decode computes the prompt (`reason` says why)
    decode: NodeInfo
    reason: PathReason

    @property
    def path(self) -> ProxyPath:
        return ProxyPath.DECODE_ONLY if self.prefill is None else ProxyPath.DISAGGREGATED


class Dispatcher:
    """Routes requests to nodes and their replies back to the waiting handler.

    Args:
        decode_only_below: prompts of which the decode node lacks fewer than this many tokens go decode-only (0:
            none for their length).
        routing: PREFIX places prompts where their prefix is cached (module docstring); LOAD by free blocks.
        prefix_ttl_s: how long a decode node is taken to hold what it was last sent or answered.
        prefill_max_in_flight: requests in flight on one prefill node before it takes no more (0: no limit).
        watch_period_s: how often the watchdog reads the live decode nodes.
        left_grace_s: how long a request's decode node is missing before the request fails.
    """

    def __init__(self, directory: KVDirectory, host: str, *, decode_only_below: int = 0,
                 prefill_max_in_flight: int = 0, routing: RoutingPolicy = RoutingPolicy.PREFIX,
                 prefix_ttl_s: float = 120.0, watch_period_s: float = WATCH_PERIOD_S,
                 left_grace_s: float = LEFT_GRACE_S):  # fmt: skip
        self._directory = directory
        self._routing, self._prefix_ttl_s = routing, prefix_ttl_s
        self._index: PrefixIndex | None = None  # made with the first decode node that keeps a prefix cache
        self._decoding: dict[str, Decoding] = {}  # request id -> what it holds on its decode node
        self._ended: dict[str, collections.deque[Ended]] = {}  # decode node key -> requests that ended there
        self._decode_only_below, self._prefill_max_in_flight = decode_only_below, prefill_max_in_flight
        self._watch_period_s, self._left_grace_s = watch_period_s, left_grace_s
        self._ctx = zmq.asyncio.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        limit_receive(self._pull)
        self.reply_to = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self._work = PushSockets(self._ctx)  # work to nodes' work endpoints
        self._queues: dict[str, asyncio.Queue] = {}
        self._serving: dict[str, tuple[str, int]] = {}  # request id -> (decode node id, epoch)
        self._decoding_at: dict[str, str] = {}  # request id -> its decode node's work endpoint
        self._missing_since: dict[str, float] = {}  # request id -> when the watch first missed its decode node
        self._prefilling_on: dict[str, str] = {}  # request id -> its prefill node, until its first reply
        self._rr = itertools.count()
        self._nodes: tuple[float, list[NodeInfo]] = (float("-inf"), [])  # (when read, live nodes of every role)
        self._nodes_lock = threading.Lock()
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
        """Live nodes of `role` (None: of every role), from one directory read of every role shared by the picks of
        the next NODES_FRESH_S (a node that just left may still be picked meanwhile, as within its heartbeat TTL:
        a prefill node that is gone costs a recompute, a decode node that is gone a retryable 503). It may read
        the directory: not on the event loop."""
        with self._nodes_lock:
            when, nodes = self._nodes
            if time.monotonic() - when > NODES_FRESH_S:
                try:
                    nodes = self._directory.live_nodes()
                except DirectoryError as exc:
                    raise APIError(503, f"directory unavailable: {exc}", type_="service_unavailable") from None
                self._nodes = (time.monotonic(), nodes)
        return [n for n in nodes if role is None or n.role == role]

    def pick(self, prompt: Sequence[int], disaggregate: bool = True, nodes: list[NodeInfo] | None = None,
             request_id: str = "", max_tokens: int = 0) -> Route:
        """Choose the decode node (module docstring) and, unless the request goes decode-only, the prefill node
        with the most free blocks (round robin on ties), skipping those at prefill_max_in_flight. A prefill node
        chosen counts `request_id` in flight there at once (the next pick sees it); the decode node chosen is
        taken to hold the prompt from now (the prefix index), and what it answers `request_id` after it.

        `nodes`: the live nodes of every role (`live_nodes()`); read here when not given. `submit` reads them on a
        thread and picks on the event loop, so that a request cancelled meanwhile was never counted.

        Without a live decode node nothing can be served (503).
        """
        route = self._route(prompt, disaggregate, self.live_nodes() if nodes is None else nodes, request_id)
        predicted = self._predicted(route.decode)
        if request_id:
            size = route.decode.block_size
            blocks = -(-(len(prompt) + max_tokens) // size) if size else 0
            self._decoding[request_id] = Decoding(_key(route.decode), list(prompt), 0, predicted, blocks, time.time())
        if predicted and self._index is not None:
            self._index.record(_key(route.decode), prompt)
        return route

    def _route(self, prompt: Sequence[int], disaggregate: bool, nodes: list[NodeInfo], request_id: str) -> Route:
        """`pick`'s choice, recording nothing but the prefill node's count."""
        turn = next(self._rr)  # one turn per request, shared by both picks, so ties rotate for each role
        decodes = [n for n in nodes if n.role == NodeRole.DECODE]
        held = self._held(prompt, decodes)
        uncached = self._uncached_blocks(prompt, held)
        decode = self._cheapest(decodes, turn, lambda n: uncached(n) + self._load(n))
        if decode is None:
            raise APIError(503, "no live decode node", type_="service_unavailable")
        if not disaggregate:
            return Route(None, decode, PathReason.NOT_ASKED)
        cached = held.get(_key(decode), 0)
        if len(prompt) - cached < self._decode_only_below:
            return Route(None, decode, PathReason.CACHED_ON_DECODE if cached else PathReason.SHORT_PROMPT)
        prefills = [n for n in nodes if n.role == NodeRole.PREFILL]
        if not prefills:
            return Route(None, decode, PathReason.NO_PREFILL_INSTANCE)
        limit = self._prefill_max_in_flight
        there = collections.Counter(self._prefilling_on.values()) if limit else collections.Counter()
        prefill = self._cheapest([n for n in prefills if not limit or there[n.node_id] < limit], turn,
                                 lambda n: -n.free_blocks)
        if prefill is None:
            return Route(None, decode, PathReason.PREFILL_SATURATED)
        self._prefilling_on[request_id] = prefill.node_id
        return Route(prefill, decode, PathReason.PREFILLED)

    def _held(self, prompt: Sequence[int], decodes: list[NodeInfo]) -> dict[str, int]:
        """How many of `prompt`'s first tokens each decode node (by `_key`) holds in its prefix cache, predicted."""
        if self._routing == RoutingPolicy.LOAD or not prompt:
            return {}
        caching = [n for n in decodes if n.prefix_cache and n.block_size]
        if self._index is None and caching:
            self._index = PrefixIndex(caching[0].block_size, self._prefix_ttl_s)
        if self._index is None:
            return {}
        return self._index.held(prompt, [_key(n) for n in caching if self._predicted(n)])

    def _predicted(self, node: NodeInfo) -> bool:
        """Whether the index predicts `node`'s prefix cache (one that keeps it, in blocks of the index's size)."""
        return self._index is not None and node.prefix_cache and node.block_size == self._index.block_size

    def _load(self, node: NodeInfo) -> int:
        """`node`'s blocks in use now, as well as this router knows (module docstring): its last heartbeat, less
        this router's requests that ended since, plus those picked for it since."""
        beat, key, used = node.heartbeat_at, _key(node), node.total_blocks - node.free_blocks
        if not beat:  # a node that does not say when it beat: the heartbeat alone
            return used
        since = sum(d.blocks for d in self._decoding.values() if d.node == key and d.started > beat)
        gone = sum(e.blocks for e in self._ended.get(key, ()) if e.started <= beat < e.ended)
        return max(0, used - gone) + since

    def _end(self, request_id: str, finished: bool) -> None:
        """The request is no longer in flight on its decode node: its last token came (`finished`: a node that
        keeps a prefix cache holds its prompt and answer now), or it is forgotten."""
        entry = self._decoding.pop(request_id, None)
        if entry is None:
            return
        now = time.time()
        ended = self._ended.setdefault(entry.node, collections.deque())
        ended.append(Ended(entry.started, now, entry.blocks))
        while ended and ended[0].ended < now - ENDED_KEEP_S:
            ended.popleft()
        if finished and entry.predicted and self._index is not None:
            self._index.answered(entry.node, entry.prompt, entry.generated)

    def _uncached_blocks(self, prompt: Sequence[int], held: dict[str, int]) -> Callable[[NodeInfo], int]:
        """The prompt's blocks a decode node does not hold (0 for every node when nothing is predicted)."""
        if self._index is None or not held:
            return lambda node: 0
        size = self._index.block_size
        return lambda node: -(-(len(prompt) - held.get(_key(node), 0)) // size)

    @staticmethod
    def _cheapest(nodes: list[NodeInfo], turn: int, cost: Callable[[NodeInfo], int]) -> NodeInfo | None:
        """The node of the least `cost`; ties in turn."""
        if not nodes:
            return None
        return max(enumerate(nodes), key=lambda p: (-cost(p[1]), (p[0] + turn) % len(nodes)))[1]

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     disaggregate: bool = True) -> tuple[Route, asyncio.Queue]:
        nodes = await asyncio.to_thread(self.live_nodes)
        route = self.pick(prompt_ids, disaggregate, nodes, request_id, sampling.max_tokens)  # counted as it picks
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._serving[request_id] = (route.decode.node_id, route.decode.epoch)
        self._decoding_at[request_id] = route.decode.work_endpoint
        if route.prefill is not None:  # its producer tells the decode node's consumer directly (an older node: its
            kv_ready = route.decode.kv_ready_endpoint or route.decode.work_endpoint  # work socket)
            await self._push(route.prefill, PrefillWork(request_id=request_id, prompt_token_ids=prompt_ids,
                                                        kv_ready_endpoint=kv_ready))
        elif route.reason == PathReason.NO_PREFILL_INSTANCE:
            log.warning("request %s: no live prefill node; decode computes the prompt", request_id)
        await self._push(route.decode, DecodeWork(request_id=request_id, prompt_token_ids=prompt_ids,
                                                  sampling=sampling, reply_to=self.reply_to,
                                                  prefill_node=route.prefill.node_id if route.prefill else "",
                                                  prefill_epoch=route.prefill.epoch if route.prefill else 0))
        return route, queue

    def cancel(self, request_id: str) -> None:
        """Tell the request's decode node to stop it (no-op once forgotten); its queue takes nothing more."""
        self._queues.pop(request_id, None)
        endpoint = self._decoding_at.pop(request_id, None)
        if endpoint is None:
            return
        sock = cast(zmq.asyncio.Socket, self._work.get(endpoint))
        # never waits: a node whose queue is full finishes the request on its own, and nobody reads it
        sent = cast(asyncio.Future, sock.send(pack(CancelWork(request_id=request_id)), zmq.NOBLOCK))
        sent.add_done_callback(lambda f: _log_unsent(f, request_id))

    def forget(self, request_id: str) -> None:
        self._prefilled(request_id)
        self._end(request_id, finished=False)
        self._queues.pop(request_id, None)
        self._decoding_at.pop(request_id, None)
        self._serving.pop(request_id, None)
        self._missing_since.pop(request_id, None)

    async def _watch_decode_nodes(self) -> None:
        while True:
            await asyncio.sleep(self._watch_period_s)
            if not self._serving:
                continue
            try:  # draining nodes still finish what they hold
                live = await asyncio.to_thread(self._directory.live_nodes, NodeRole.DECODE, include_draining=True)
            except DirectoryError:
                continue  # no verdict without the directory; the request timeout still applies
            self._fail_orphaned({(n.node_id, n.epoch) for n in live}, time.monotonic())

    def _fail_orphaned(self, alive: set[tuple[str, int]], now: float) -> None:
        """Fail each request whose decode node has been missing from `alive` for the left grace."""
        for rid, (node, epoch) in list(self._serving.items()):
            if (node, epoch) in alive:
                self._missing_since.pop(rid, None)
                continue
            since = self._missing_since.setdefault(rid, now)
            queue = self._queues.get(rid)
            if now - since >= self._left_grace_s and queue is not None:
                del self._serving[rid]
                del self._missing_since[rid]
                log.warning("request %s: decode node %s (epoch %d) left the cluster", rid, node, epoch)
                queue.put_nowait(WorkError(request_id=rid, node=node, kind=ErrorKind.NODE_LOST,
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
            self._prefilled(msg.request_id)
            if isinstance(msg, TokenChunk):
                self._answered(msg)
            queue = self._queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)

    def _answered(self, chunk: TokenChunk) -> None:
        """Count a request's generated tokens; once it is finished it is no longer in flight, and a decode node
        that keeps a prefix cache holds them after its prompt."""
        if (entry := self._decoding.get(chunk.request_id)) is None:
            return
        self._decoding[chunk.request_id] = entry._replace(generated=entry.generated + len(chunk.token_ids))
        if chunk.finished:
            self._end(chunk.request_id, finished=True)

    def _prefilled(self, request_id: str) -> None:
        """The request is no longer in flight on its prefill node: its decode node replied, or it is forgotten."""
        self._prefilling_on.pop(request_id, None)


def _key(node: NodeInfo) -> str:
    """A node's incarnation, what holds a prefix cache: a restarted node's starts empty."""
    return f"{node.node_id}@{node.epoch}"


def _log_unsent(sent: asyncio.Future, request_id: str) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("request %s: could not cancel it on its decode node: %s", request_id, sent.exception())
