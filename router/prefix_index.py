"""Which instance holds which prompt prefix in its prefix cache, in KV blocks, predicted from the router's own
routing (as Dynamo's approximate KV router and llm-d's prefix-cache scorer do).

A prompt's token ids are cut into blocks of `block_size` tokens (the servers' KV block size); each full block
is named by a hash chained over every token before it (engine/block_names.py), so a name stands for the whole
prefix up to its block's end, as in vLLM's own prefix cache and kvwire's decode nodes'.

Lifecycle of an entry:

1. `record(url, prompt)` when the router sends a prompt to `url`: every full block of it is held there from now.
2. `answered(url, prompt, generated)` once `url` answered it: the prompt's last, partial block and the
   `generated` tokens after it are held there too, as the start of whatever prompt continues it (the next
   turn of a conversation continues its last prompt with the answer the instance generated), all but the
   last: a sampled token's KV is written when it is fed back, and the last one never is.
3. `held(prompt, urls)`: how many of `prompt`'s tokens each instance holds, in whole blocks.

Each takes the prompt's cache `scope` (ROOT: the base model's, no salt): vLLM keeps a LoRA adapter's, a cache
salt's and a prompt with media in prefix caches of their own (router/vllm/cache_scope.py), so a prompt's chain of
names starts at its scope, and the same tokens in two scopes share no block.
4. An entry not recorded again for `ttl_s` is taken as evicted; `forget(url)` drops all of an instance's (it
   left rotation: a restarted server's cache is empty).

An instance whose own KV events the router reads (router/kv_events.py) is EXACT: `stored` and `removed` keep
its entries as its prefix cache says, with no expiry, and `record` / `answered` predict nothing for it.

Not shared between threads: the router's event loop owns it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvwire.engine.block_names import ROOT as _ROOT
from kvwire.engine.block_names import block_names, next_name
from kvwire.router.kv_events import VLLMBlockHash


class Tail(NamedTuple):
    """What an instance holds past a prompt's last full block: that block's partial rest, then `generated` tokens."""

    tokens: tuple[int, ...]
    generated: int  # the answer's tokens whose KV the instance wrote: all but its last
    at: float


class PrefixIndex:
    """Predicted prefix caches of a set of instances."""

    def __init__(self, block_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 1_000_000):
        if block_size < 1 or ttl_s <= 0:
            raise ValueError("the block size and the prefix TTL must be positive")
        self.block_size = block_size
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_entries = max_entries
        self._blocks: dict[bytes, dict[str, float]] = {}  # block name -> instance -> when last recorded
        self._tails: dict[tuple[str, bytes], Tail] = {}  # (instance, name of the prompt's last full block) -> rest
        self._entries = 0
        self._exact: dict[str, dict[VLLMBlockHash, bytes]] = {}  # EXACT instance -> its block hashes -> our names

    def record(self, url: str, prompt: Sequence[int], scope: bytes = _ROOT) -> None:
        """`url` was sent `prompt`: its full blocks are held there from now."""
        if url in self._exact:
            return
        now = self._clock()
        for name in block_names(prompt, self.block_size, scope):
            holders = self._blocks.setdefault(name, {})
            self._entries += url not in holders
            holders[url] = now
        if self._entries > self._max_entries:
            self._prune(now)

    def answered(self, url: str, prompt: Sequence[int], generated: int, scope: bytes = _ROOT) -> None:
        """`url` answered `prompt` with `generated` tokens: it holds the prompt's rest and those past it."""
        if url in self._exact:
            return
        names = block_names(prompt, self.block_size, scope)
        rest = tuple(prompt[len(names) * self.block_size:])
        self._tails[(url, names[-1] if names else scope)] = Tail(rest, max(0, generated - 1), self._clock())

    def held(self, prompt: Sequence[int], urls: Iterable[str], scope: bytes = _ROOT) -> dict[str, int]:
        """Returns: for each of `urls`, how many of `prompt`'s first tokens it holds, a multiple of the block size."""
        names, now, size = block_names(prompt, self.block_size, scope), self._clock(), self.block_size
        out = {}
        for url in urls:
            full = 0
            while full < len(names) and self._fresh(self._blocks.get(names[full], {}).get(url), now):
                full += 1
            tokens = full * size
            tail = self._tails.get((url, names[full - 1] if full else scope))
            if tail is not None and self._fresh(tail.at, now) and tuple(prompt[tokens:tokens + len(tail.tokens)]) \
                    == tail.tokens:
                tokens = min(len(prompt), tokens + len(tail.tokens) + tail.generated) // size * size
            out[url] = tokens
        return out

    def stored(self, url: str, parent: VLLMBlockHash | None, tokens: Sequence[int],
               hashes: Sequence[VLLMBlockHash], scope: bytes = _ROOT) -> bool:
        """`url`'s prefix cache (its KV events) stored blocks `hashes` of `tokens`, after the block `parent` (None:
        at the start of a prompt of `scope`). Returns: False when `parent` is one it never told of (events missed,
        or blocks kvwire does not name: router/vllm/cache_scope.py)."""
        known = self._exact.setdefault(url, {})
        name = scope if parent is None else known.get(parent)
        if name is None:
            return False
        size = self.block_size
        for i, block_hash in enumerate(hashes):
            block = tuple(tokens[i * size:(i + 1) * size])
            if len(block) < size:
                break
            name = next_name(name, block)
            known[block_hash] = name
            holders = self._blocks.setdefault(name, {})
            self._entries += url not in holders
            holders[url] = math.inf
        return True

    def removed(self, url: str, hashes: Sequence[VLLMBlockHash]) -> None:
        """`url`'s prefix cache evicted blocks `hashes`."""
        known = self._exact.setdefault(url, {})
        for block_hash in hashes:
            name = known.pop(block_hash, None)
            if name is not None and (holders := self._blocks.get(name)) and holders.pop(url, None) is not None:
                self._entries -= 1

    def cleared(self, url: str) -> None:
        """`url` is EXACT from now, and holds nothing (its cache was cleared, or its events start)."""
        self.forget(url)
        self._exact[url] = {}

    def forget(self, url: str) -> None:
        """Drop everything `url` held (it left rotation)."""
        for holders in self._blocks.values():
            self._entries -= holders.pop(url, None) is not None
        self._blocks = {name: holders for name, holders in self._blocks.items() if holders}
        self._tails = {key: tail for key, tail in self._tails.items() if key[0] != url}
        if url in self._exact:
            self._exact[url] = {}

    def _fresh(self, at: float | None, now: float) -> bool:
        return at is not None and (at == math.inf or now - at < self._ttl_s)

    def _prune(self, now: float) -> None:
        """Drop the entries past their TTL; then, if more than half the size is left, the oldest (those recorded
        at one time, by one `record`, all kept or all dropped: a prefix is held whole or not at all)."""
        by_time: dict[float, list[tuple[bytes, str]]] = {}
        for name, holders in self._blocks.items():
            for url, at in holders.items():
                if self._fresh(at, now):
                    by_time.setdefault(at, []).append((name, url))
        kept, self._blocks = 0, {}
        for at in sorted(by_time, reverse=True):
            if kept and kept + len(by_time[at]) > self._max_entries // 2:
                break
            for name, url in by_time[at]:
                self._blocks.setdefault(name, {})[url] = at
            kept += len(by_time[at])
        self._entries = kept
        self._tails = {key: tail for key, tail in self._tails.items() if self._fresh(tail.at, now)}
