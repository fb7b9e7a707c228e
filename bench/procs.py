"""How the benches start their helper processes (a producer, a sender, an engine): forked from one fork
server that imported torch and kvwire's transfer plane once, instead of a fresh interpreter importing them
for each (a second or more; more on a busy host). Each child is still its own process, with its own UCX
context, sockets and pools: the server imports no UCX, touches no device and starts no thread before it
forks. The server is one per process: it preloads every module asked for until its first child starts.

A forked child inherits the server's environment, the one the bench process had when the server started,
not the one it has when the child starts: settings meant for a child (UCX's) travel as arguments and the
child applies them itself first (`apply_env`), before it loads what reads them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Mapping, Sequence
from multiprocessing.context import ForkServerContext

PRELOAD = ("torch", "kvwire.connectors.standalone", "kvwire.bench.workload")
LOG_LEVEL = "KVWIRE_BENCH_LOG_LEVEL"  # helpers log at this level (`log_everywhere`); unset: Python's default
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"


_preload: list[str] = list(PRELOAD)  # what every caller so far asked for, in order


def helper_context(extra: Sequence[str] = ()) -> ForkServerContext:
    """The fork-server context, its server preloading PRELOAD, `extra` and what earlier callers asked for
    (modules, imported in order; once its first child has started, it has what it has)."""
    _preload.extend(m for m in extra if m not in _preload)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_preload))
    return ctx


def log_everywhere(level: str) -> None:
    """Log at `level` here and in every helper started from now on (`child_env` carries it).

    Raises:
        ValueError: not a logging level's name.
    """
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    os.environ[LOG_LEVEL] = level.upper()


def child_env(env: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """`env` and this process's log level (`log_everywhere`), for a helper to `apply_env`."""
    level = os.environ.get(LOG_LEVEL)
    return {**(env or {}), **({LOG_LEVEL: level} if level else {})}


def apply_env(env: Mapping[str, str | None]) -> None:
    """This process's environment with `env` applied (None: unset), e.g. first thing in a helper process; and
    its logging at the level `env` names (`child_env`), if any."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if level := env.get(LOG_LEVEL):
        logging.basicConfig(level=level, format=LOG_FORMAT)
