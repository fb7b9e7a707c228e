"""Which host a process runs on, as far as sharing memory goes."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path


@functools.cache
def host_identity() -> str:
    """Equal for processes that can share memory with each other, different otherwise.

    The hostname and the kernel's boot id name the machine; the network and IPC namespaces
    tell apart containers (pods) on one machine, which share a kernel and often a hostname
    but reach each other only over the network. A namespace that cannot be read counts as
    the same one.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/net:{_namespace('net')}/ipc:{_namespace('ipc')}"


def elsewhere(identity: str) -> bool:
    """A peer's `host_identity()` names another host (or container) than ours; "" (a peer that did not
    say) counts as ours."""
    return bool(identity) and identity != host_identity()


def _namespace(kind: str) -> int:
    """The inode of this process's `kind` namespace (0 where /proc does not say)."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def machine_of(identity: str) -> str:
    """The machine part of a `host_identity()` (the kernel's boot id): equal for two containers on one
    machine whose namespaces differ; "" when unknown."""
    parts = identity.split("/")
    return parts[1] if len(parts) > 2 else ""
