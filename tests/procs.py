"""How tests start their helper processes (a producer, a prefill rank): forked from one fork server that
imported torch, kvwire's transfer plane and the tests' peer helpers once (bench/procs.py), so a child starts
in milliseconds instead of a fresh interpreter importing torch for a second or more. Each child is still
its own process: its own UCX context, sockets and pool, as a real peer has.

`FORK` starts a local cluster's nodes and router the same way (cluster/forked.py): each runs the kvwire CLI
with the arguments `kvwire prefill|decode|router` would get, in a process of its own, without the second
or two a fresh interpreter spends importing torch and kvwire. `kvwire up` and the CLI tests still exec.
"""

from __future__ import annotations

from kvwire.bench.procs import helper_context
from kvwire.cluster.forked import ForkLauncher

CTX = helper_context(["tests.connectors.peer", "kvwire.cli.main", "kvwire.cli.node_cmd", "kvwire.cli.router_cmd",
                      "kvwire.prefill_node.main", "kvwire.decode_node.main", "kvwire.router.app", "uvicorn",
                      "tests.procs"])


def run_kvwire(argv: list[str]) -> None:
    """`kvwire ARGV`, in this process (a forked child's entry)."""
    from kvwire.cli.main import app

    app(argv, prog_name="kvwire")


FORK = ForkLauncher(CTX, run_kvwire)
