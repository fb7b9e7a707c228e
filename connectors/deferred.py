"""Calls run a little later on one thread of their own: work that must happen, but not now.

A producer that has told its consumer directly where the KV is writes the directory's READY
a few milliseconds later through this (producer/role.py), so that the write, Redis's work on it
and the consumer's directory watcher waking up for it do not compete for the cores with the
consumer's pull and first token.

Lifecycle:

1. `Deferred(name)` starts the thread (a daemon: it never keeps a process alive).
2. `call_in(delay_s, fn)` queues `fn`; the thread runs it once it is due, in due order. A
   call that raises is logged; the next ones still run.
3. `close()` runs what is still queued at once (nothing is silently dropped), then stops.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Deferred:
    def __init__(self, name: str):
        self._queue: list[tuple[float, int, Callable[[], None]]] = []  # (due, order, fn)
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_in(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run `fn` on the thread `delay_s` from now. After `close` it runs here, now."""
        with self._cond:
            if not self._closing:
                heapq.heappush(self._queue, (time.monotonic() + delay_s, next(self._order), fn))
                self._cond.notify()
                return
        _run_one(fn)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._cond.wait(self._queue[0][0] - time.monotonic() if self._queue else None)
                if not self._queue:  # closing, and nothing left
                    return
                _, _, fn = heapq.heappop(self._queue)
            _run_one(fn)


def _run_one(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - one failed call must not stop the rest
        log.exception("deferred call failed")
