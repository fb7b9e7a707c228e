"""Two-rank process groups, one per (producer, consumer) pair, and their rendezvous.

Lifecycle of a pair:

1. The producer hosts one `TCPStore` (its transport address, `host:port`).
2. A consumer that has no live group with that producer connects to the store, writes
   the id of the pull that opens the pair under its own key (`open_key`), then sends that
   pull's `PullRequest`.
3. Both sides build the group concurrently under the store prefix
   `pair_prefix(consumer, opened)`: the consumer as rank 1 on its receive thread, the
   producer as rank 0 on that consumer's lane when it serves the pull (it reads the open
   id back from the store).
4. Later pulls reuse the group.
5. Any failure (deadline, dead peer, refused pull) discards the group on the side that
   saw it: Gloo cannot cancel an operation, but a dropped group closes its connections,
   so the peer's pending operations fail at once and the next pull opens a new pair under
   a new prefix (a prefix is never built twice).

Gloo moves CPU tensors, NCCL CUDA tensors; the pool's device decides. Every piece
travels as one flat uint8 tensor, tagged with its transfer and index.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import socket
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend

from kvwire.connectors.transports.kv_region import as_bytes

PIECE_BITS = 16  # low tag bits: piece index within one transfer
MAX_PIECES = 1 << PIECE_BITS
_TRANSFER_MASK = (1 << (31 - PIECE_BITS)) - 1  # tags are positive 32-bit ints
MIN_TIMEOUT_S = 0.001
PRODUCER, CONSUMER = 0, 1  # ranks within a pair


class Backend(enum.StrEnum):
    GLOO = "gloo"
    NCCL = "nccl"


def backend_for(device: torch.device) -> Backend:
    """NCCL for a CUDA pool, Gloo for a CPU pool."""
    return Backend.NCCL if device.type == "cuda" else Backend.GLOO


def tag_for(transfer_id: int, piece: int) -> int:
    return ((transfer_id & _TRANSFER_MASK) << PIECE_BITS) | piece


def consumer_key(transport_address: bytes) -> str:
    """A store-safe name for the consumer behind a published transport address."""
    return hashlib.sha256(transport_address).hexdigest()[:32]


def open_key(consumer: str) -> str:
    return f"kvwire/open/{consumer}"


def pair_prefix(consumer: str, opened: int) -> str:
    return f"kvwire/pair/{consumer}/{opened}"


def timeout_until(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(MIN_TIMEOUT_S, deadline - time.monotonic()))


def detached(exc: BaseException) -> BaseException:
    """`exc` without its traceback (and context), whose frames would keep a failed transfer's
    operations alive, and with them the group's connections that discarding it must close."""
    exc.__traceback__ = None
    exc.__context__ = None
    return exc


def host_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, bytes]:
    """Start this producer's rendezvous store on `host` (that address only).

    Returns:
        The store and its transport address, `b"host:port"`.
    """
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    port = listener.getsockname()[1]
    # The store takes the bound socket over (and closes it); without it, it listens on every interface.
    store = dist.TCPStore(host, port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=True)
    return store, f"{host}:{port}".encode()


def parse_address(address: bytes) -> tuple[str, int]:
    """Split a producer's transport address.

    Raises:
        ValueError: not `host:port`.
    """
    host, sep, port = address.decode("ascii", errors="replace").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"transport address {address[:64]!r} is not host:port")
    return host, int(port)


def connect_store(address: bytes, deadline: float) -> dist.TCPStore:
    """Connect to a producer's store, failing fast when nothing listens there.

    Raises:
        ValueError: malformed address.
        OSError: refused, or not connected by `deadline`.
    """
    host, port = parse_address(address)
    remaining = max(MIN_TIMEOUT_S, deadline - time.monotonic())
    # TCPStore retries a refused connection until its timeout; a plain probe tells a dead producer at once.
    socket.create_connection((host, port), timeout=remaining).close()
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout_until(deadline),
                             wait_for_workers=False, use_libuv=True)
    except RuntimeError as exc:  # c10d's DistNetworkError / DistStoreError
        raise OSError(f"cannot reach the store at {host}:{port}: {exc}") from exc


class GroupFactory:
    """Builds pair groups for one process's pool (one Gloo device, bound to `host`, shared)."""

    def __init__(self, host: str, device: torch.device):
        self.device = device
        self.backend = backend_for(device)
        self._gloo_device = dist.ProcessGroupGloo.create_device(hostname=host) if self.backend == Backend.GLOO else None

    def build(self, store: dist.Store, prefix: str, rank: int, deadline: float) -> PairGroup:
        """Join the pair under `prefix` as `rank`; blocks until the peer joins or `deadline`.

        Raises:
            RuntimeError: the peer did not join in time, or the store failed.
        """
        pstore = dist.PrefixStore(prefix, store)
        timeout = timeout_until(deadline)
        if self.backend == Backend.GLOO:
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs know only Options
            opts._devices = [self._gloo_device]
            opts._timeout = timeout
            opts._threads = 1  # point-to-point runs on the device's thread, not the pool's
            return PairGroup(dist.ProcessGroupGloo(pstore, rank, 2, opts), rank, self.device)
        with torch.cuda.device(self.device):
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            if hasattr(opts, "config"):
                opts.config.blocking = 0  # non-blocking communicator: waits honour timeouts, abort works
            return PairGroup(dist.ProcessGroupNCCL(pstore, rank, 2, opts), rank, self.device)


class PairGroup:
    """One built 2-rank group; used by one thread at a time."""

    def __init__(self, pg: C10dBackend, rank: int, device: torch.device):
        self._pg: C10dBackend | None = pg  # a ProcessGroupGloo or ProcessGroupNCCL
        self._peer = 1 - rank
        self._device = device

    def post_sends(self, pieces: list[torch.Tensor], transfer_id: int) -> list[dist.Work]:
        """Start one send per piece to the peer, in order.

        Raises:
            RuntimeError: the group is discarded or its connection is closed.
        """
        return self._post(pieces, transfer_id, send=True)

    def post_recvs(self, pieces: list[torch.Tensor], transfer_id: int) -> list[dist.Work]:
        """Post one receive per piece, straight into the piece's memory, in order."""
        return self._post(pieces, transfer_id, send=False)

    def wait_all(self, works: list[dist.Work], deadline: float) -> None:
        """Block until every operation completes.

        Raises:
            TimeoutError: not complete by `deadline`.
            RuntimeError: the peer went away or the transport failed.
        """
        for work in works:
            if not work.wait(timeout_until(deadline)):
                raise TimeoutError("point-to-point operation did not complete before the deadline")

    def discard(self) -> None:
        """Drop the group: its connections close, so neither side can touch the pieces again."""
        pg, self._pg = self._pg, None
        if pg is not None and self._device.type == "cuda":
            pg.abort()  # NCCL keeps running kernels otherwise; Gloo closes on destruction

    def _post(self, pieces: list[torch.Tensor], transfer_id: int, send: bool) -> list[dist.Work]:
        if self._pg is None:
            raise RuntimeError("pair group was discarded")
        op = self._pg.send if send else self._pg.recv  # type: ignore[attr-defined]  # torch's stubs omit them
        ctx = torch.cuda.device(self._device) if self._device.type == "cuda" else nullcontext()
        with ctx:
            return [op([as_bytes(p)], self._peer, tag_for(transfer_id, i)) for i, p in enumerate(pieces)]
