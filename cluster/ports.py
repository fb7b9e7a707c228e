"""Ports for the local processes kvwire starts (clusters, Redis, vLLM servers), told to them before they bind.

A port the kernel hands out for bind(0) comes from its ephemeral range, where every outgoing connection on
the machine also takes its local port: between the pick and the child's bind, a busy machine often gives
the port away (seen: a node's ops endpoint failed with EADDRINUSE while other tests ran). So the pick is
random below that range, where only listeners go, and checked by binding it once.
"""

from __future__ import annotations

import random
import socket

SPAN = 12000  # ports below the ephemeral range to pick from


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, outside the kernel's ephemeral range."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - SPAN), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
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
