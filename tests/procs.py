"""How tests start their helper processes (a producer, a prefill rank): forked from one fork server that
imported torch, kvwire's transfer plane and the tests' peer helpers once (bench/procs.py), so a child starts
in milliseconds instead of a fresh interpreter importing torch for a second or more. Each child is still
its own process: its own UCX context, sockets and pool, as a real peer has.
"""

from __future__ import annotations

from kvwire.bench.procs import helper_context

CTX = helper_context(["tests.connectors.peer"])
