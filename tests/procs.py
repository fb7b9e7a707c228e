"""How tests start their helper processes (a producer, a prefill rank): from one fork server that imported
torch and kvwire's transfer plane once, so a child starts in milliseconds instead of a fresh interpreter
importing torch for a second or more (more on a busy host). Each child is still its own process: its own
UCX context, sockets and pool, as a real peer has. The fork server imports no UCX and starts no thread
before it forks, so nothing of either is inherited.
"""

from __future__ import annotations

import multiprocessing as mp

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "kvwire.connectors.standalone", "tests.connectors.peer"])
