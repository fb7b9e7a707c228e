"""No silent slow path: a consumer checks what will carry a same-host producer's KV.

The rule. A shared-memory path is *expected* when both hold:

- the producer is on this host: its location's `host` equals our `host_identity()` (a
  producer that publishes no host, an older build, is never expected to be near);
- this consumer's connector can share memory with it: auto (kvwire's own shared memory
  with same-host producers that offer it, UCX otherwise), shm, or ucx (UCX picks
  sysv/posix/cma by itself when two processes can share memory). tcp and nccl were chosen
  knowing they do not (NCCL picks its own path), so nothing is expected of them.

A pull, once `Transport.choose` narrowed its location:

1. Not expected to be fast: it goes on, unchecked.
2. Expected: the transport says what will carry it (`Transport.data_path`; for UCX, what
   UCX selected for the endpoint to that producer, which exists from then on).
3. The path crosses the network stack (UCX on tcp alone: typically two containers on one
   host without a shared /dev/shm or IPC namespace): warn once per producer and path,
   naming both; with `require_fast_path`, refuse the pull (the consumer recomputes,
   kvwire_kv_transfers_failed{reason="slow_path"}).
4. The path cannot be known (the UCX query failed): say so once and go on; refusing on a
   guess would recompute every request over a missing symbol.

The containers trap proper: a producer on this machine (same boot id) but in another
network or IPC namespace (another pod) is another host to kvwire, so nothing is expected
of it; its KV crossing the network stack is still worth a warning once per producer (one
machine could share memory, given a shared IPC namespace), and `require_fast_path`
refuses it the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvwire.connectors.config import ConnectorConfig, ConnectorKind
from kvwire.connectors.transports.data_path import DataPath, PathClass
from kvwire.connectors.transports.host import host_identity, machine_of
from kvwire.connectors.wire import KVLocation

log = logging.getLogger(__name__)

SHARED_MEMORY_KINDS = frozenset({ConnectorKind.AUTO, ConnectorKind.SHM, ConnectorKind.UCX})
MAX_TOLD = 4096  # (producer, path) pairs remembered as already logged; forgotten all at once past this


def expected_path(loc: KVLocation) -> str:
    """The shared-memory path a same-host pull over `loc.kind` should take."""
    return "shm" if loc.kind == ConnectorKind.SHM else "sysv/posix/cma (UCX shared memory)"


def same_machine_elsewhere(kind: ConnectorKind, loc: KVLocation) -> bool:
    """Whether `loc`'s producer runs on this machine in other namespaces (a pod beside ours)."""
    mine = host_identity()
    return (kind in SHARED_MEMORY_KINDS and bool(loc.host) and loc.host != mine
            and machine_of(loc.host) != "" and machine_of(loc.host) == machine_of(mine))


def expects_shared_memory(kind: ConnectorKind, loc: KVLocation) -> bool:
    """Whether a consumer of connector `kind` should reach `loc`'s producer through shared memory."""
    return kind in SHARED_MEMORY_KINDS and bool(loc.host) and loc.host == host_identity()


class FastPathGuard:
    """A consumer's check of each pull's data path (see the module docstring).

    Args:
        config: the consumer's settings (`kind`, `require_fast_path`).
        data_path: what will carry a narrowed location's bytes (the transport's `data_path` over our puller).
    """

    def __init__(self, config: ConnectorConfig, data_path: Callable[[KVLocation], DataPath]):
        self._kind = config.kind
        self._require = config.require_fast_path
        self._data_path = data_path
        self._told: set[tuple[str, str]] = set()  # (producer, path) already logged
        self._lock = threading.Lock()

    def refusal(self, loc: KVLocation) -> str | None:
        """Why the pull of `loc` (narrowed by `choose`) must not go on, or None: it may.

        Logs a slow or unknown path once per producer and path.
        """
        near = same_machine_elsewhere(self._kind, loc)
        if not near and not expects_shared_memory(self._kind, loc):
            return None
        path = self._data_path(loc)
        if path.path_class == PathClass.UNKNOWN:
            self._once(loc.producer, path, logging.INFO, "producer %s is on this host, but which path its KV takes "
                       "over %s cannot be told: %s", loc.producer, loc.kind, path)
            return None
        if path.path_class != PathClass.NETWORK_STACK:
            return None
        where = ("runs on this machine in another container (network / IPC namespace): shared memory needs a "
                 "shared IPC namespace" if near else "is on this host")
        why = (f"producer {loc.producer} {where}: expected {expected_path(loc)}, actual {path.label} "
               f"(over {loc.kind}), which crosses the network stack")
        action = "refusing its KV (--require-fast-path): recomputing" if self._require else \
            "pulling anyway (--require-fast-path refuses instead)"
        self._once(loc.producer, path, logging.WARNING, "%s; %s", why, action)
        return why if self._require else None

    def _once(self, producer: str, path: DataPath, level: int, fmt: str, *args: object) -> None:
        key = (producer, str(path))
        with self._lock:
            if key in self._told:
                return
            if len(self._told) >= MAX_TOLD:
                self._told.clear()
            self._told.add(key)
        log.log(level, fmt, *args)
