"""The producer's table of published requests whose KV blocks it holds until pulled.

The table is the one owner of those blocks between publish and release:

1. `add`: the request's prefill is published (layer-wise: before its forward).
2. `begin_pull`: a consumer's pull claims it (`end_pull` hands it back if refused). Most
   requests have one puller; a tensor-parallel one has as many as the consumer ranks that
   read this copy (`HeadSlice.pullers`), each pulling once, possibly at the same time.
3. `finish_pull` (the last of its pullers ended, well or not) or `release`; or
   `expire_due`: its hold deadline passed with no pull in flight; or `release_if_idle`:
   nobody will pull it.

The release callback, given at construction, fires exactly once per request with the
block ids it held, whichever way it leaves; `before_release`, when given, fires just before
it with the request's location (shared memory zeroes its hold word there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvwire.connectors.producer.layer_gate import LayerGate
from kvwire.connectors.wire import KVLocation


@dataclass
class HeldRequest:
    location: KVLocation
    hidden: list[torch.Tensor]  # contiguous, in location.hidden order
    deadline: float  # time.monotonic() after which an idle request is released
    pulling: set[str] = field(default_factory=set)  # consumers whose pull is in flight
    pulled: set[str] = field(default_factory=set)  # consumers whose pull ended
    pullers: int = 1  # how many consumers pull it (set by the first pull)

    @property
    def in_flight(self) -> bool:
        return bool(self.pulling)
    published_at: float = field(default_factory=time.monotonic)
    gate: LayerGate | None = None  # layer-wise: how much of the prefill is done (hidden filled in at the end)


class HeldTable:
    """Thread-safe: the engine thread adds, the transfer server takes and finishes."""

    def __init__(self, on_release: Callable[[str, list[int]], None],
                 before_release: Callable[[KVLocation], None] | None = None):
        """Args:
        on_release: `(request_id, block_ids)` once the request's blocks are no longer needed.
        before_release: `(location)` first, before the blocks can be reused.
        """
        self._items: dict[str, HeldRequest] = {}
        self._lock = threading.Lock()
        self._on_release = on_release
        self._before_release = before_release or (lambda location: None)

    def add(self, held: HeldRequest) -> None:
        with self._lock:
            assert held.location.request_id not in self._items, "request published twice"
            self._items[held.location.request_id] = held

    def begin_pull(self, request_id: str, consumer: str = "", pullers: int = 1) -> HeldRequest | None:
        """Mark `consumer`'s pull of a request in flight; None if unknown, released, or `consumer` pulls or
        pulled it already, or (one puller) anyone does; or `pullers` differs from what its first pull said."""
        with self._lock:
            held = self._items.get(request_id)
            if held is None or consumer in held.pulling | held.pulled or pullers < 1:
                return None
            if held.pulling or held.pulled:
                if pullers != held.pullers or held.pullers == 1:
                    return None
            held.pullers = pullers
            held.pulling.add(consumer)
            return held

    def end_pull(self, request_id: str, consumer: str = "") -> None:
        """A pull was refused before anything moved: the request may be pulled again (by its real consumer)."""
        with self._lock:
            held = self._items.get(request_id)
            if held is not None:
                held.pulling.discard(consumer)

    def finish_pull(self, request_id: str, consumer: str = "") -> bool:
        """`consumer`'s pull ended (well or not): the request is released once every puller's has.
        Returns whether this released it."""
        with self._lock:
            held = self._items.get(request_id)
            if held is None:
                return False
            held.pulling.discard(consumer)
            held.pulled.add(consumer)
            if len(held.pulled) < held.pullers:
                return False
        return self.release(request_id)

    def release(self, request_id: str) -> bool:
        """Drop a request and fire the callback; False if it was not held."""
        with self._lock:
            held = self._items.pop(request_id, None)
        if held is None:
            return False
        self._fire(held)
        return True

    def release_if_idle(self, request_id: str) -> bool:
        """Release a request no pull is moving; False if it is in flight (its pull's end releases it) or gone."""
        with self._lock:
            held = self._items.get(request_id)
            if held is None or held.in_flight:
                return False
            del self._items[request_id]
        self._fire(held)
        return True

    def _fire(self, held: HeldRequest) -> None:
        try:
            self._before_release(held.location)
        finally:  # the blocks go back whatever happened
            self._on_release(held.location.request_id, held.location.block_ids)

    def get(self, request_id: str) -> HeldRequest | None:
        with self._lock:
            return self._items.get(request_id)

    def idle_locations(self) -> list[KVLocation]:
        """Where the KV of each held request nobody is pulling is."""
        with self._lock:
            return [h.location for h in self._items.values() if not h.in_flight]

    def expire_due(self, now: float) -> list[str]:
        """Release every idle request whose deadline has passed; return their ids."""
        with self._lock:
            due = [rid for rid, h in self._items.items() if not h.in_flight and h.deadline <= now]
        return [rid for rid in due if self.release(rid)]

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((h.deadline for h in self._items.values() if not h.in_flight), default=None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def release_all(self) -> None:
        with self._lock:
            ids = list(self._items)
        for rid in ids:
            self.release(rid)
