"""Where a request goes, and whether it is disaggregated: the router's prefill/decode scheduler in vLLM mode.

For each request, once its prompt's token ids are known (router/vllm/tokens.py):

1. DECODE INSTANCE (`place`): the UP decode instance of the least cost, in KV blocks:
       cost = the prompt blocks it does not hold (router/prefix_index.py's prediction) + its load
   (router/vllm/pool.py: the blocks of the requests in flight there, or in use by its own count, plus those
   queued). A conversation's later turns go where its earlier turns' KV is, unless that instance is busier
   than computing the prompt elsewhere costs; unrelated prompts hold nothing anywhere and spread by load.
   With `RoutingPolicy.LOAD` the prompt is not read and the load alone decides.
2. PATH (`place`): decode-only when the part of the prompt that instance does not hold is shorter than
   `decode_only_below` tokens (PathReason.CACHED_ON_DECODE when it holds some, SHORT_PROMPT when none):
   computing it there costs less than a prefill instance's round trip and the pull; else disaggregated.
3. PREFILL INSTANCE (`prefill`): the UP prefill instance of the least cost, the same way, among those whose KV
   block size pairs with the decode instance's (one divides the other, as their metrics show; not yet shown
   counts as pairing) and whose KV cache is of the same kind (--kv-cache-dtype: the model's, or one fp8): a pull
   between others is refused as a mismatch, so with none the request goes decode-only
   (PathReason.PREFILL_OTHER_BLOCK_SIZE or PREFILL_OTHER_KV_CACHE_DTYPE, an ERROR once per decode instance).
4. The prediction: what each instance was sent is held there from then (`sent`), and a decode instance's
   answer adds the tokens it generated (`answered`), which the conversation's next prompt starts with.
   An instance that leaves rotation is forgotten (its process may have restarted with an empty cache).
   Each prompt is named in its cache scope (router/vllm/cache_scope.py: its LoRA adapter, cache_salt, media),
   as vLLM keeps it: the same tokens under another adapter are not held.
   A decode instance whose KV events the router reads (`kv_events`, router/kv_events.py) is exact instead:
   its entries are what its prefix cache says, from its first event on.

The block size is each pool's own, read from its instances' metrics (vllm:cache_config_info); until one
shows it, requests are placed by load and the path decided on the whole prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvwire.connectors.config import NodeRole
from kvwire.engine.block_names import ROOT
from kvwire.observability.labels import InstanceState, PathReason
from kvwire.router.config import RoutingPolicy
from kvwire.router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvwire.router.prefix_index import PrefixIndex
from kvwire.router.vllm.cache_scope import stored_scope
from kvwire.router.vllm.pool import InstancePool

log = logging.getLogger(__name__)


class Placement(NamedTuple):
    """Where a request's decode step goes and what that instance holds of it.

    Attributes:
        decode: the decode instance's base URL.
        held: how many of them the decode instance holds (predicted).
        blocks: the request's weight in an instance's load (its prompt blocks; 1 when not read).
        decode_only: why it goes decode-only without a prefill instance; None: disaggregate if one is up.
    """

    decode: str
    held: int
    blocks: int
    decode_only: PathReason | None


class Scheduler:
    """The prefix indexes of both pools and the policy over them (module docstring)."""

    def __init__(self, policy: RoutingPolicy, decode_only_below: int, ttl_s: float, prefill: InstancePool,
                 decode: InstancePool, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.decode_only_below = decode_only_below
        self._ttl_s = ttl_s
        self._clock = clock
        self._pools = {NodeRole.PREFILL: prefill, NodeRole.DECODE: decode}
        self._indexes: dict[NodeRole, PrefixIndex] = {}
        self._up = {role: set(pool.urls(InstanceState.UP)) for role, pool in self._pools.items()}
        self._exact: set[str] = set()  # decode instances whose KV events came
        self._unlike: set[str] = set()  # ... whose events' block size is not the index's (said once)
        self._said_no_block_size = False
        self._unpaired: set[tuple[str, PathReason]] = set()  # decode instances no prefill instance paired, and why
        # (said once)

    def reads_prompts(self) -> bool:
        """Whether a request's prompt must be tokenized to place it."""
        several = any(len(pool.urls(InstanceState.UP)) + len(pool.urls(InstanceState.DOWN)) > 1
                      for pool in self._pools.values())
        return self.decode_only_below > 0 or (self.policy == RoutingPolicy.PREFIX and several)

    def place(self, tokens: Sequence[int] | None, avoid: frozenset[str] = frozenset(),
              scope: bytes = ROOT) -> Placement | None:
        """Returns: the decode instance for a prompt of `tokens` in cache scope `scope` and its path (steps 1 and 2);
        None: none is UP."""
        index, pool = self._index(NodeRole.DECODE), self._pools[NodeRole.DECODE]
        if index is None and tokens and self.policy == RoutingPolicy.PREFIX and not self._said_no_block_size:
            self._said_no_block_size = True
            log.warning("no decode instance's GET /metrics has shown vllm:cache_config_info's block_size yet: "
                        "requests are placed by load alone until one does")
        held = index.held(tokens, pool.urls(InstanceState.UP), scope) if index and tokens else {}
        blocks = _blocks(tokens, index)
        url = pool.pick(avoid, self._uncached(tokens, held, index), blocks)
        if url is None:
            return None
        if tokens and log.isEnabledFor(logging.DEBUG):
            log.debug("a prompt of %d tokens: held %s, load %s; placed on %s", len(tokens), held,
                      {u: pool.load(u, blocks) for u in pool.urls(InstanceState.UP)}, url)
        return Placement(url, held.get(url, 0), blocks, self._path(tokens, held.get(url, 0)))

    def prefill(self, tokens: Sequence[int] | None, decode: str, scope: bytes = ROOT) -> str | PathReason:
        """Returns: the prefill instance for a prompt of `tokens` that decode instance `decode` takes (step 3): one
        whose KV block size pairs with its (router/vllm/pool.py, `pairs`); else why none."""
        index, pool = self._index(NodeRole.PREFILL), self._pools[NodeRole.PREFILL]
        held = index.held(tokens, pool.urls(InstanceState.UP), scope) if index and tokens else {}
        size, quant = self._pools[NodeRole.DECODE].block_size_of(decode), self._pools[NodeRole.DECODE].kv_quant_of(
            decode)
        url = pool.pick(cost=self._uncached(tokens, held, index), request_blocks=_blocks(tokens, index),
                        block_size=size, kv_quant=quant)
        if url is not None:
            return url
        if not pool.count(InstanceState.UP):
            return PathReason.NO_PREFILL_INSTANCE
        if pool.pick(block_size=size) is not None:  # of the block size, not of the KV cache's kind
            reason, why = PathReason.PREFILL_OTHER_KV_CACHE_DTYPE, (
                f"a KV cache of {quant or 'the model dtype'}, and no prefill instance up keeps one of that kind "
                "(KV moves between caches of one --kv-cache-dtype only)")
        else:
            reason, why = PathReason.PREFILL_OTHER_BLOCK_SIZE, (
                f"KV blocks of {size} tokens, and no prefill instance up pairs with it ("
                f"{', '.join(f'{u}: {n}' for u, n in pool.block_sizes().items())}; KV moves between block sizes only "
                "where one divides the other)")
        if (decode, reason) not in self._unpaired:
            self._unpaired.add((decode, reason))
            log.error("decode instance %s keeps %s: its requests go decode-only (reason %s) until one does; serve "
                      "prefill and decode alike", decode, why, reason)
        return reason

    def sent(self, role: NodeRole, url: str, tokens: Sequence[int] | None, scope: bytes = ROOT) -> None:
        """`url`, an instance of `role`, was sent a prompt of `tokens` in cache scope `scope`."""
        if tokens and (index := self._index(role)) is not None:
            index.record(url, tokens, scope)

    def answered(self, url: str, tokens: Sequence[int] | None, generated: int, scope: bytes = ROOT) -> None:
        """Decode instance `url` answered a prompt of `tokens` in cache scope `scope` with `generated` tokens."""
        if tokens and (index := self._index(NodeRole.DECODE)) is not None:
            index.answered(url, tokens, generated, scope)

    def back(self, role: NodeRole, urls: Sequence[str]) -> None:
        """Instances `urls` of `role` came back into rotation: restarted, perhaps, so holding nothing yet (their KV
        events, if read, say what they hold from then on)."""
        if (index := self._indexes.get(role)) is not None:
            for url in urls:
                index.forget(url)

    def kv_events(self, url: str, events: Sequence[KVEvent]) -> None:
        """Decode instance `url`'s prefix cache changed as `events` say (router/kv_events.py)."""
        index = self._index(NodeRole.DECODE)
        if index is None:
            size = next((e.block_size for e in events if isinstance(e, BlockStored)), 0)
            if not size:
                return
            index = self._indexes[NodeRole.DECODE] = PrefixIndex(size, self._ttl_s, self._clock)
        if url not in self._exact:
            self._exact.add(url)
            index.cleared(url)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                index.cleared(url)
            elif event.group_idx not in (None, 0):
                continue  # a hybrid model's other groups (sliding window, state): the prefix is the first's
            elif isinstance(event, BlockRemoved):
                index.removed(url, event.block_hashes)
            elif event.block_size != index.block_size:
                if url not in self._unlike:
                    self._unlike.add(url)
                    log.warning("vLLM instance %s: KV events of %d-token blocks, the index's are %d: not used", url,
                                event.block_size, index.block_size)
            elif (named := stored_scope(event)) is not None:
                root, count = named
                index.stored(url, event.parent_block_hash, event.token_ids, event.block_hashes[:count], root)

    def _path(self, tokens: Sequence[int] | None, held: int) -> PathReason | None:
        if tokens is None or len(tokens) - held >= self.decode_only_below:
            return None
        return PathReason.CACHED_ON_DECODE if held else PathReason.SHORT_PROMPT

    def _uncached(self, tokens: Sequence[int] | None, held: dict[str, int],
                  index: PrefixIndex | None) -> Callable[[str], float] | None:
        if self.policy == RoutingPolicy.LOAD or not tokens or index is None:
            return None
        size = index.block_size
        return lambda url: -(-(len(tokens) - held.get(url, 0)) // size)

    def _index(self, role: NodeRole) -> PrefixIndex | None:
        """`role`'s index, made once its instances showed their block size; instances that left it forgotten."""
        pool = self._pools[role]
        up = set(pool.urls(InstanceState.UP))
        index = self._indexes.get(role)
        if index is None and (size := pool.block_size()):
            index = self._indexes[role] = PrefixIndex(size, self._ttl_s, self._clock)
        if index is not None:
            for url in self._up[role] - up:
                index.forget(url)
        self._up[role] = up
        return index


def _blocks(tokens: Sequence[int] | None, index: PrefixIndex | None) -> int:
    return -(-len(tokens) // index.block_size) if tokens and index else 1
