"""How the benches start their helper processes (a producer, a sender, an engine): forked from one fork
server that imported torch and kvwire's transfer plane once, instead of a fresh interpreter importing them
for each (a second or more; more on a busy host). Each child is still its own process, with its own UCX
context, sockets and pools: the server imports no UCX, touches no device and starts no thread before it
forks. The server is one per process: the first child started fixes its preload.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext

PRELOAD = ("torch", "kvwire.connectors.standalone", "kvwire.bench.workload")


def helper_context(extra: Sequence[str] = ()) -> ForkServerContext:
    """The fork-server context, its server preloading PRELOAD and `extra` (modules, imported in order)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *extra])
    return ctx
