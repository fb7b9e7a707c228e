"""Which host a process runs on, as far as sharing memory goes."""

from __future__ import annotations

import functools
import socket
from pathlib import Path


@functools.cache
def host_identity() -> str:
    """Hostname plus the kernel's boot id: equal for processes that can share memory on one machine."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
