"""Ports for the local processes kvwire starts (clusters, Redis, vLLM servers), told to them before they bind.

A port the kernel hands out for bind(0) comes from its ephemeral range, where every outgoing connection on
the machine also takes its local port: between the pick and the child's bind, a busy machine often gives
the port away (seen: a node's ops endpoint failed with EADDRINUSE while other tests ran). So the pick is
random below that range, where only listeners go, and checked by binding it once. A port handed out is not
handed out again by this process for GIVEN_S: a caller that picks several before starting any (a cluster's
processes, a test's servers) gets distinct ones, where two random picks of the same port were one in 4,000 for
three (seen: a test's third stand-in server failed with EADDRINUSE on its second one's port).
"""

from __future__ import annotations

import random
import socket
import threading
import time

SPAN = 12000  # ports below the ephemeral range to pick from
GIVEN_S = 600.0  # a port handed out is not handed out again for this long
_given: dict[int, float] = {}  # port -> when this process handed it out
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, outside the kernel's ephemeral range."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - SPAN), low)
        with _lock:
            now = time.monotonic()
            if now - _given.get(port, -GIVEN_S) < GIVEN_S:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            if len(_given) >= 4096:  # a long-lived process: forget what has aged out
                for old in [p for p, at in _given.items() if now - at >= GIVEN_S]:
                    del _given[old]
            _given[port] = now
            return port
    with socket.socket() as s:  # that whole span in use: the kernel's pick, race and all
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
