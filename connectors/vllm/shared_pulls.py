"""Requests of one vLLM server whose kv_transfer_params name the same producer's KV: vLLM gives every child of a
request with n > 1 (or best_of) its parent's params, so without this each would pull the one KV the producer holds
for one pull. The first pulls it; the others start from it through vLLM's prefix cache.

A key's life here (the scheduler half calls it, on vLLM's scheduler thread):

1. `pulling(key, rid)`: request `rid` is to pull `key` (its blocks allocated). Another request naming `key`
   now waits (`must_wait`: vLLM asks it again at a later step).
2. `scheduled(rids)`: a step's scheduled requests. Once `rid` is among them its pull has ended: its blocks
   are in vLLM's prefix cache (received, or being recomputed after a failed pull, which vLLM caches as it
   computes them). Or `ended(rid)`: it finished or was aborted first. Either way `key` is `pulled`.
3. A request naming a pulled key starts from the prefix cache and pulls nothing (scheduler.py counts it when
   the cache holds less than the prompt's full blocks: vLLM's prefix caching off, or the blocks evicted).
"""

from __future__ import annotations

import collections
from collections.abc import Collection

MAX_PULLED = 4096  # keys remembered as pulled (a request's children arrive together: only the latest matter)


class SharedPulls:
    def __init__(self) -> None:
        self._first: dict[str, str] = {}  # key -> the request pulling it, until it is scheduled after its pull
        self._pulled: collections.OrderedDict[str, None] = collections.OrderedDict()

    def must_wait(self, key: str, rid: str) -> bool:
        """Whether `rid` must wait for another request's pull of `key`."""
        first = self._first.get(key)
        return first is not None and first != rid

    def pulled(self, key: str) -> bool:
        """Whether another request of this server pulled `key` (its prompt is in the prefix cache, if cached)."""
        return key in self._pulled

    def pulling(self, key: str, rid: str) -> None:
        self._first[key] = rid

    def scheduled(self, rids: Collection[str]) -> None:
        """A step's scheduled requests: those that pulled have their blocks in the prefix cache now."""
        if self._first:
            for key in [k for k, rid in self._first.items() if rid in rids]:
                self._done(key)

    def ended(self, rid: str) -> None:
        """`rid` finished or was aborted (no step may schedule it again)."""
        for key in [k for k, first in self._first.items() if first == rid]:
            self._done(key)

    def _done(self, key: str) -> None:
        del self._first[key]
        self._pulled[key] = None
        while len(self._pulled) > MAX_PULLED:
            self._pulled.popitem(last=False)
