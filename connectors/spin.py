"""Polling a peer without starving it: yield while something moves, nap once nothing has for a while.

kvwire's data paths poll rather than block where a wake-up per step costs throughput (UCX: every rendezvous
step needs both workers progressed). Polling with `sched_yield` between polls is not safe where the peer, or
anyone the peer needs, shares the core: on Linux's EEVDF scheduler (measured on 6.18) a thread that yields
without pause can keep a runnable thread on its core off it for tens of seconds. With a vLLM prefill rank and
a decode server on one core, the producer's server thread spinning on a pull kept the decode server, the very
peer it waited for, off the core until the pull's 30 s deadline (docs/BENCHMARKS.md). Sleeping leaves the run
queue, yielding does not: so a `Spin` yields only while something moves, and once nothing has for `quiet_s`
it naps `nap_s` between polls, until something moves again.

Lifecycle: one `Spin` per polling loop (its own thread); `pause(moved)` after each poll, `reset()` when the
loop blocked instead (a blocking wait is not a quiet spin).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

QUIET_S = 0.002  # polls that moved nothing for this long: whoever should move is not running; nap
NAP_S = 0.0002  # one nap: the core goes to its other threads (the timer's slack makes it 250-300 us here)


class Spin:
    def __init__(self, quiet_s: float = QUIET_S, nap_s: float = NAP_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self._quiet_s, self._nap_s = quiet_s, nap_s
        self._clock, self._sleep = clock, sleep
        self._moved_at = clock()

    def reset(self) -> None:
        """The loop blocked (or starts): it is not spinning on a quiet peer."""
        self._moved_at = self._clock()

    def pause(self, moved: bool) -> None:
        """Between two polls: yield if something moved within `quiet_s`, else nap."""
        now = self._clock()
        if moved:
            self._moved_at = now
        if now - self._moved_at < self._quiet_s:
            os.sched_yield()
        else:
            self._sleep(self._nap_s)
