"""The data path: which transports really carry a transfer's bytes, and what kind of path that is.

kvwire's own transports name themselves ("tcp", "shm", "nccl"); over UCX the path is what
UCX selected for the endpoint (ucx/query.py), its transport names joined by "/" in lane
order with duplicates dropped, e.g. "sysv/cma" or "tcp". A path UCX could not be asked
about is "unknown", with the reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PathClass(enum.StrEnum):
    """What a data path costs, coarsely."""

    SHARED_MEMORY = "shared_memory"  # the bytes stay in this host's memory (sysv, posix, cma, xpmem, cuda_ipc, shm)
    RDMA = "rdma"  # through an RDMA NIC, bypassing the kernel's network stack (rc, dc, ud, ...)
    NETWORK_STACK = "network_stack"  # through the kernel's sockets, even on one host (tcp, Gloo)
    UNKNOWN = "unknown"  # not known (the query failed, or the transport picks for itself, like NCCL)


# UCX transport names (`ucx_info -d`) and kvwire's own, by what they cost. "self" is a loopback
# within one worker: shared memory in effect.
_SHARED_MEMORY = frozenset({"self", "sysv", "posix", "xpmem", "cma", "knem", "cuda_ipc", "rocm_ipc", "shm"})
_NETWORK_STACK = frozenset({"tcp", "sockcm", "gloo"})
_RDMA_PREFIXES = ("rc", "dc", "ud", "ib", "gga", "srd")  # rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ...


def classify(transport: str) -> PathClass:
    """What kind of path one transport name is."""
    if transport in _SHARED_MEMORY:
        return PathClass.SHARED_MEMORY
    if transport in _NETWORK_STACK:
        return PathClass.NETWORK_STACK
    if transport.startswith(_RDMA_PREFIXES):
        return PathClass.RDMA
    return PathClass.UNKNOWN


@dataclass(frozen=True)
class DataPath:
    """The transports of one path, in lane order, or why they are not known.

    Attributes:
        transports: transport names, e.g. ("sysv", "cma"); empty when unknown.
        unknown_reason: why `transports` is empty.
    """

    transports: tuple[str, ...] = ()
    unknown_reason: str = ""

    @classmethod
    def of(cls, names: list[str]) -> DataPath:
        """The path over `names` (one per lane, repeats allowed)."""
        return cls(tuple(dict.fromkeys(names)))

    @classmethod
    def unknown(cls, reason: str) -> DataPath:
        return cls((), reason)

    @property
    def label(self) -> str:
        """"sysv/cma", "tcp", or "unknown"."""
        return "/".join(self.transports) or "unknown"

    @property
    def path_class(self) -> PathClass:
        """Shared memory if any lane is; else RDMA if any lane is; else the network stack if any lane is.

        Generous on purpose: what must be caught is a same-host pair with no fast lane at all
        (UCX on tcp alone, the containers trap), never a mixed endpoint UCX chose itself.
        """
        classes = {classify(t) for t in self.transports}
        for c in (PathClass.SHARED_MEMORY, PathClass.RDMA, PathClass.NETWORK_STACK):
            if c in classes:
                return c
        return PathClass.UNKNOWN

    def __str__(self) -> str:
        return self.label if self.transports else f"unknown ({self.unknown_reason})"
