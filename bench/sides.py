"""Two spawned bench processes, a producer (side 0) and a consumer (side 1), stepped over a pipe each.

Used by the baselines that run both ends themselves (NIXL, bare ucxx). Lifecycle:

1. The constructor starts both, each given its side and its end of a pipe; each applies `env` before the
   target runs (a fork-server child does not see the bench's environment of the moment: bench/procs.py).
2. `recv` waits for a side's next message, failing as soon as either process has died or
   the deadline passed.
3. `close` joins both (and kills what is left).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvwire.bench.procs import apply_env, helper_context

TIMEOUT_S = 120.0


class Sides:
    def __init__(self, target: Callable, args: tuple, env: Mapping[str, str | None], what: str):
        """Start `target(*args, side, pipe)` for side 0 and side 1, with `env` applied (None unsets)."""
        ctx = helper_context()
        pipes = [ctx.Pipe() for _ in range(2)]
        self._what = what
        self._procs = [ctx.Process(target=_in_env, args=(dict(env), target, *args, s, pipes[s][1]), daemon=True)
                       for s in (0, 1)]
        for p in self._procs:
            p.start()
        self.ends = [pipes[s][0] for s in (0, 1)]

    def recv(self, side: int):
        end, deadline = self.ends[side], time.monotonic() + TIMEOUT_S
        while not end.poll(0.2):
            if time.monotonic() > deadline or not all(p.is_alive() for p in self._procs):
                codes = [p.exitcode for p in self._procs]
                raise RuntimeError(f"a {self._what} bench process stopped answering (exit codes {codes})")
        return end.recv()

    def send(self, side: int, msg) -> None:
        self.ends[side].send(msg)

    def close(self) -> None:
        for p in self._procs:
            p.join(30)
            p.kill()


def _in_env(env: dict[str, str | None], target: Callable, *args) -> None:
    apply_env(env)
    target(*args)
