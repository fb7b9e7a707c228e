"""Where a request of this router goes over kvwire's own nodes: its decode node and, unless it goes decode-only,
its prefill node.

A pick (`Placement.pick`, asked by the dispatcher, router/dispatch.py):

1. The decode node is the one of the least cost in KV blocks: the prompt's blocks it does not hold in its prefix
   cache (predicted, router/prefix_index.py: what it was sent, and what it answered, which a conversation's next
   prompt starts with) plus its load: the blocks in use there by its last heartbeat, less those of this router's
   requests that ended there since, plus those of its requests picked for it since (each reserves its prompt and
   max_tokens); ties in turn. A later turn goes where its conversation's KV is unless that node is busier than
   computing the prompt elsewhere costs. With `RoutingPolicy.LOAD`, or no decode node keeping a prefix cache, the
   load alone decides.
2. The request goes decode-only (the decode node computes the prompt, no prefill node) when the client asked so,
   when the part of its prompt that node does not hold is shorter than `decode_only_below` tokens (a short
   prompt, or a cached one), when no prefill node is live, when none serves its checkpoint or keeps KV blocks of
   its size (its KV would be refused as a mismatch), or when every live prefill node has
   `prefill_max_in_flight` requests of this router in flight. Otherwise the prefill node is the one of the least
   cost: the prompt's blocks it does not hold in its prefix cache (predicted from the prompts it was sent) less
   its free blocks; ties in turn. Prompts sharing a system prompt go where it was computed, unless that node has
   fewer free blocks than computing it elsewhere costs.
3. The pick returns the request's `Reservation`, which the dispatcher keeps in the request's in-flight record
   (router/in_flight.py) and hands back at every later pick: it holds a slot on its prefill node until its first
   reply, and its blocks on its decode node until its last token (or it is forgotten).
4. `ended()`: the request left its decode node. Its blocks are remembered there for ENDED_KEEP_S, to correct
   heartbeats taken while it ran; a finished one's answer is held in that node's prefix cache after its prompt.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory
from kvwire.connectors.wire import NodeInfo, models_agree
from kvwire.observability.labels import PathReason, ProxyPath
from kvwire.router.config import RoutingPolicy
from kvwire.router.prefix_index import PrefixIndex
from kvwire.router.schemas import APIError

NODES_FRESH_S = 0.25  # picks reuse the directory's node list this long (heartbeats refresh it every few seconds)
ENDED_KEEP_S = 30.0  # requests that ended are remembered this long, to correct heartbeats older than their end


@dataclass(eq=False)
class Reservation:
    """What a request of this router holds for placement, from its pick. Made by `Placement.pick`; kept in the
    request's in-flight record and written only by the dispatcher's event loop (router/dispatch.py), which clears
    `prefill` at the request's first reply and hands the reservation to `Placement.ended` at its last token.

    Attributes:
        node: its decode node's incarnation (`_key`).
        prompt: its prompt's token ids.
        predicted: the prefix index predicts that node's cache: what it answers is held there after.
        blocks: what it reserves there: its prompt and max_tokens, in the node's blocks (0: size unknown).
        started: wall-clock time of the pick, to compare with the node's heartbeats.
        prefill: its prefill node's id until its first reply ("": none, or it replied).
        generated: tokens answered so far.
    """

    node: str
    prompt: list[int]
    predicted: bool
    blocks: int
    started: float
    prefill: str = ""
    generated: int = 0


class Ended(NamedTuple):
    started: float
    ended: float
    blocks: int


@dataclass(frozen=True)
class Route:
    prefill: NodeInfo | None  # None: decode computes the prompt (`reason` says why)
    decode: NodeInfo
    reason: PathReason
    held: int = 0  # the prompt tokens the decode node holds in its prefix cache (predicted, or as it said)

    @property
    def path(self) -> ProxyPath:
        return ProxyPath.DECODE_ONLY if self.prefill is None else ProxyPath.DISAGGREGATED


class Placement:
    """Chooses the nodes of each request (module docstring). Owns the node list read, the prefix index and the
    requests that ended on each decode node; the requests in flight are the caller's, given at each pick.

    Args:
        decode_only_below: prompts of which the decode node lacks fewer than this many tokens go decode-only (0:
            none for their length).
        routing: PREFIX places prompts where their prefix is cached (module docstring); LOAD by free blocks.
        prefix_ttl_s: how long a decode node is taken to hold what it was last sent or answered.
        prefill_max_in_flight: requests in flight on one prefill node before it takes no more (0: no limit).
    """

    def __init__(self, directory: KVDirectory, *, decode_only_below: int = 0, prefill_max_in_flight: int = 0,
                 routing: RoutingPolicy = RoutingPolicy.PREFIX, prefix_ttl_s: float = 120.0):
        self._directory = directory
        self._routing, self._prefix_ttl_s = routing, prefix_ttl_s
        self._decode_only_below, self._prefill_max_in_flight = decode_only_below, prefill_max_in_flight
        self._index: PrefixIndex | None = None  # made with the first node that keeps a prefix cache
        self._ended: dict[str, collections.deque[Ended]] = {}  # decode node key -> requests that ended there
        self._rr = itertools.count()
        self._nodes: tuple[float, list[NodeInfo]] = (float("-inf"), [])  # (when read, live nodes of every role)
        self._nodes_lock = threading.Lock()

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

    def fresh_nodes(self) -> list[NodeInfo] | None:
        """The live nodes of every role if read within NODES_FRESH_S, else None (then `live_nodes` reads them).
        Never reads the directory: safe on the event loop, where a request then needs no thread to be placed."""
        with self._nodes_lock:
            when, nodes = self._nodes
        return nodes if time.monotonic() - when <= NODES_FRESH_S else None

    def pick(self, prompt: Sequence[int], disaggregate: bool, nodes: list[NodeInfo],
             reserved: Collection[Reservation], max_tokens: int = 0) -> tuple[Route, Reservation]:
        """Choose the decode node and, unless the request goes decode-only, the prefill node (module docstring).
        The decode node chosen is taken to hold the prompt from now (the prefix index).

        Args:
            nodes: the live nodes of every role (`live_nodes()`).
            reserved: the reservations of this router's requests in flight (what they hold on their nodes).
            max_tokens: the request's, reserved on its decode node with its prompt.

        Returns:
            The route, and the request's reservation: it counts once the caller hands it back in `reserved`.

        Raises:
            APIError: 503 without a live decode node.
        """
        route = self._route(prompt, disaggregate, nodes, reserved)
        predicted = self._predicted(route.decode)
        size = route.decode.block_size
        blocks = _blocks_of(len(prompt) + max_tokens, size)
        reservation = Reservation(_key(route.decode), list(prompt), predicted, blocks, time.time(),
                                  prefill=route.prefill.node_id if route.prefill else "")
        if predicted and self._index is not None:
            self._index.record(_key(route.decode), prompt)
        if route.prefill is not None and self._predicted(route.prefill) and self._index is not None:
            self._index.record(_key(route.prefill), prompt)  # its prefix cache keeps the prompt's blocks
        return route, reservation

    def shared(self, decode: NodeInfo, prompt: Sequence[int], max_tokens: int) -> Reservation:
        """The reservation of a request's later choice on `decode`, which starts from its first choice's prompt
        blocks there: only its blocks past the prompt's full ones."""
        size = decode.block_size
        blocks = _blocks_of(len(prompt) + max_tokens, size) - (len(prompt) // size if size else 0)
        return Reservation(_key(decode), list(prompt), False, blocks, time.time())

    def ended(self, reservation: Reservation, finished: bool) -> None:
        """The request is no longer in flight on its decode node: its last token came (`finished`: a node that
        keeps a prefix cache holds its prompt and answer now), or it is forgotten."""
        now = time.time()
        ended = self._ended.setdefault(reservation.node, collections.deque())
        ended.append(Ended(reservation.started, now, reservation.blocks))
        while ended and ended[0].ended < now - ENDED_KEEP_S:
            ended.popleft()
        if finished and reservation.predicted and self._index is not None:
            self._index.answered(reservation.node, reservation.prompt, reservation.generated)

    def _route(self, prompt: Sequence[int], disaggregate: bool, nodes: list[NodeInfo],
               reserved: Collection[Reservation]) -> Route:
        """`pick`'s choice, recording nothing."""
        turn = next(self._rr)  # one turn per request, shared by both picks, so ties rotate for each role
        decodes = [n for n in nodes if n.role == NodeRole.DECODE]
        held = self._held(prompt, decodes)
        uncached = self._uncached_blocks(prompt, held)
        decode = self._cheapest(decodes, turn, lambda n: uncached(n) + self._load(n, reserved))
        if decode is None:
            raise APIError(503, "no live decode node", type_="service_unavailable")
        if not disaggregate:
            return Route(None, decode, PathReason.NOT_ASKED)
        cached = held.get(_key(decode), 0)
        if len(prompt) - cached < self._decode_only_below:
            return Route(None, decode, PathReason.CACHED_ON_DECODE if cached else PathReason.SHORT_PROMPT, cached)
        prefills = [n for n in nodes if n.role == NodeRole.PREFILL]
        if not prefills:
            return Route(None, decode, PathReason.NO_PREFILL_INSTANCE)
        prefills = [n for n in prefills if models_agree(n.model, decode.model)]
        if not prefills:
            return Route(None, decode, PathReason.PREFILL_OTHER_MODEL)
        size = decode.block_size
        prefills = [n for n in prefills if not (n.block_size and size) or n.block_size == size]
        if not prefills:
            return Route(None, decode, PathReason.PREFILL_OTHER_BLOCK_SIZE)
        limit = self._prefill_max_in_flight
        there = collections.Counter(r.prefill for r in reserved if r.prefill) if limit else collections.Counter()
        uncached = self._uncached_blocks(prompt, self._held(prompt, prefills))
        prefill = self._cheapest([n for n in prefills if not limit or there[n.node_id] < limit], turn,
                                 lambda n: uncached(n) - n.free_blocks)
        if prefill is None:
            return Route(None, decode, PathReason.PREFILL_SATURATED)
        return Route(prefill, decode, PathReason.PREFILLED)

    def _held(self, prompt: Sequence[int], nodes: list[NodeInfo]) -> dict[str, int]:
        """How many of `prompt`'s first tokens each of `nodes` (by `_key`) holds in its prefix cache, predicted."""
        if self._routing == RoutingPolicy.LOAD or not prompt:
            return {}
        caching = [n for n in nodes if n.prefix_cache and n.block_size]
        if self._index is None and caching:
            self._index = PrefixIndex(caching[0].block_size, self._prefix_ttl_s)
        if self._index is None:
            return {}
        return self._index.held(prompt, [_key(n) for n in caching if self._predicted(n)])

    def _predicted(self, node: NodeInfo) -> bool:
        """Whether the index predicts `node`'s prefix cache (one that keeps it, in blocks of the index's size)."""
        return self._index is not None and node.prefix_cache and node.block_size == self._index.block_size

    def _load(self, node: NodeInfo, reserved: Collection[Reservation]) -> int:
        """`node`'s blocks in use now, as well as this router knows (module docstring): its last heartbeat, less
        this router's requests that ended since, plus those picked for it since."""
        beat, key, used = node.heartbeat_at, _key(node), node.total_blocks - node.free_blocks
        if not beat:  # a node that does not say when it beat: the heartbeat alone
            return used
        since = sum(r.blocks for r in reserved if r.node == key and r.started > beat)
        gone = sum(e.blocks for e in self._ended.get(key, ()) if e.started <= beat < e.ended)
        return max(0, used - gone) + since

    def _uncached_blocks(self, prompt: Sequence[int], held: dict[str, int]) -> Callable[[NodeInfo], int]:
        """The prompt's blocks a node does not hold (0 for every node when nothing is predicted)."""
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


def _key(node: NodeInfo) -> str:
    """A node's incarnation, what holds a prefix cache: a restarted node's starts empty."""
    return f"{node.node_id}@{node.epoch}"


def _blocks_of(tokens: int, size: int) -> int:
    """The KV blocks of `size` tokens that `tokens` take (0 when the size is not known)."""
    return -(-tokens // size) if size else 0
