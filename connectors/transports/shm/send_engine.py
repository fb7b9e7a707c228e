"""The producer's shared-memory send engine: consumers read the pool, we only confirm.

Lifecycle:

1. `__init__` removes the sockets of dead incarnations of this node, listens on this
   incarnation's Unix socket (its path is our transport address) and watches it with an
   epoll set whose fd the transfer server polls, so everything below runs on the server
   thread.
2. A consumer connects and says `ShmHello`; we answer `ShmSegment` with the pool's
   read-only memfd (or CUDA IPC handle) and the hold board's (hold_board.py).
3. A request whose location carries its hold word, and whose hidden states the consumer has
   (in the KVReady, `KVReady`, or the board's hidden area), is read with no claim: the
   consumer checks the word around its copy and says `ShmRead`, which claims and finishes the
   request at once here (its blocks are released).
   Otherwise a consumer claims a READY request with a `PullRequest` on this socket ("hold these
   blocks for my read") and reads its blocks straight from the pool meanwhile.
4. If the transfer server lets that pull claim the request (still held, not in flight
   elsewhere, the consumer's published address, matching block count), we answer
   `PullReply(ok, hold_s)` with the hidden states in a sealed memfd: the blocks stay held
   (a held request's blocks are never reused) until the consumer's `ShmReadDone`, its
   connection's end, or the job's deadline (hold_s from now), whichever comes first; then
   the job finishes and releases them. Otherwise (expired, released, refused) we answer
   not-ok and the consumer discards what it read.
5. `close()` closes every connection, the board's descriptor, and removes the socket file.

The answer overlaps the consumer's read: a pull costs its copy and at most one round trip.
A producer publishes READY only after its KV is written (CUDA: synchronized), so a read
never races the writes.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvwire.connectors.control.auth import AuthError
from kvwire.connectors.hidden import INLINE_MAX, host_bytes
from kvwire.connectors.transports.shm.channel import (
    SOCKET_ROOT,
    close_fds,
    listen,
    peer_cred,
    recv_msg,
    remove_stale,
    send_msg,
    socket_dir,
    socket_path,
)
from kvwire.connectors.transports.shm.hold_board import HoldBoard
from kvwire.connectors.transports.shm.segment import PoolSegment, pack_tensors
from kvwire.connectors.transports.transport import Refused, SendEngine, SendJob
from kvwire.connectors.wire import Message, PullReply, PullRequest, ShmHello, ShmRead, ShmReadDone, WireError

log = logging.getLogger(__name__)

SPIN_S = 0.002  # after a claim the server polls without sleeping this long, for the consumer's ShmReadDone


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    consumer: str = ""  # set by ShmHello
    address: bytes = b""  # the consumer's published transport address, set by ShmHello
    reading: dict[tuple[str, int], tuple[SendJob, float]] = field(default_factory=dict)  # claimed: job, when


class SHMSendEngine(SendEngine):
    def __init__(self, node_id: str, epoch: int, segment: PoolSegment, socket_root: Path = SOCKET_ROOT):
        """Args:
            node_id, epoch: this node incarnation (they name the socket).
            segment: the pool consumers map.
            socket_root: where the private socket directory is made.
        Raises:
            PermissionError: the socket directory is not private to us.
            OSError: cannot listen.
        """
        self._node_id = node_id
        self._segment = segment
        directory = socket_dir(socket_root)
        self.path = socket_path(directory, node_id, epoch)
        remove_stale(directory, node_id, keep=self.path)
        self._listener = listen(self.path)
        self.transport_address = str(self.path).encode()
        self._board = HoldBoard(node_id, epoch, segment.num_blocks)  # a request holds one block at least
        self.holds = self._board  # ServesHoldBoard (hold_board.py)
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._conns: dict[int, _Conn] = {}

    def fds(self) -> list[int]:
        return [self._epoll.fileno()]  # readable while any of our sockets is

    def progress(self) -> bool:
        events = self._epoll.poll(0)
        for fd, _ in events:
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._conns:
                self._serve(self._conns[fd])
        return bool(events)

    def start(self, job: SendJob) -> None:
        raise ValueError("shared-memory reads are confirmed on the producer's Unix socket, not the side channel")

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, "producer closing")
        self._epoll.close()
        self._listener.close()
        self._board.close()
        self.path.unlink(missing_ok=True)

    # --- connections -------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            pid, uid = peer_cred(sock)
            if uid != os.getuid():
                log.warning("node %s: refused a connection from pid %d of uid %d", self._node_id, pid, uid)
                sock.close()
                continue
            sock.setblocking(False)
            self._conns[sock.fileno()] = _Conn(sock, pid)
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _serve(self, conn: _Conn) -> None:
        while conn.sock.fileno() in self._conns:
            try:
                msg, fds = recv_msg(conn.sock, expect=(ShmHello, PullRequest, ShmReadDone, ShmRead))
            except BlockingIOError:
                return
            except (OSError, WireError) as exc:
                if isinstance(exc, AuthError):  # said, sealed, so that a consumer with another secret knows why
                    refusal = PullReply(request_id="", transfer_id=0, ok=False, reason=f"unauthenticated: {exc}")
                    self._send(conn, refusal)
                self._drop(conn, str(exc))
                return
            close_fds(fds)  # consumers have nothing to send us by descriptor
            if isinstance(msg, ShmHello):
                self._hello(conn, msg)
            elif isinstance(msg, ShmReadDone):
                self._read_done(conn, msg)
            elif isinstance(msg, ShmRead):
                self._read_direct(conn, msg)
            else:
                assert isinstance(msg, PullRequest)  # recv_msg accepts nothing else
                self._confirm(conn, msg)

    def _hello(self, conn: _Conn, msg: ShmHello) -> None:
        if conn.address:
            self._drop(conn, "second hello")
            return
        conn.consumer, conn.address = msg.consumer, msg.transport_address
        segment, fds = self._segment.export()
        segment = msgspec.structs.replace(segment, hold_slots=self._board.slots,
                                          hold_hidden_bytes=self._board.hidden_bytes)
        self._send(conn, segment, [*fds, self._board.ro_fd])
        log.debug("node %s: consumer %s (pid %d) mapped the pool", self._node_id, msg.consumer, conn.pid)

    def _confirm(self, conn: _Conn, msg: PullRequest) -> None:
        """The consumer is reading `msg`'s blocks: ok if the pull may claim the request, which then stays held
        until the consumer is done (or its connection ends, or the job's deadline)."""
        def refuse(reason: str) -> None:
            self._send(conn, PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=False,
                                       reason=reason))

        if not conn.address or msg.transport_address != conn.address:
            refuse("the read names another consumer than the one that mapped the pool")
            return
        job = self.claims.claim(msg)
        if isinstance(job, Refused):
            refuse(job.reason)
            return
        job.replied = True
        hold_s = max(0.0, job.deadline - time.monotonic())
        nbytes = sum(t.numel() * t.element_size() for t in job.held.hidden)
        if nbytes <= INLINE_MAX:  # one raw packet after the reply: no memfd to make, map and close
            reply = PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=True, hold_s=hold_s,
                              inline_bytes=nbytes)
            sent: bool | None = self._send(conn, reply) and (
                nbytes == 0 or self._send_raw(conn, host_bytes(job.held.hidden)))
        else:
            sent = self._reply_with_memfd(conn, msg, job, hold_s)
            if sent is None:
                return
        if sent:
            conn.reading[(msg.request_id, msg.transfer_id)] = (job, time.monotonic())
        else:
            self.claims.finish(job, ConnectionError("consumer gone before the confirmation"))

    def _reply_with_memfd(self, conn: _Conn, msg: PullRequest, job: SendJob, hold_s: float) -> bool | None:
        """Large hidden states: in a sealed memfd attached to the reply. None: refused (finished here)."""
        try:
            fd = pack_tensors(job.held.hidden)
        except OSError as exc:
            self._send(conn, PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=False,
                                       reason=f"cannot hand over the hidden states: {exc}"))
            self.claims.finish(job, exc)
            return None
        try:
            return self._send(conn, PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=True,
                                              hold_s=hold_s), [] if fd is None else [fd])
        finally:
            if fd is not None:
                close_fds([fd])

    def _send_raw(self, conn: _Conn, data: memoryview) -> bool:
        try:
            conn.sock.send(data)
            return True
        except OSError as exc:
            self._drop(conn, f"send failed: {exc}")
            return False

    def _read_done(self, conn: _Conn, msg: ShmReadDone) -> None:
        """The consumer has read (ok) or given up: the job finishes and the blocks are released."""
        claimed = conn.reading.pop((msg.request_id, msg.transfer_id), None)
        if claimed is not None:  # unknown: refused, or released at its deadline already
            self.claims.finish(claimed[0], None if msg.ok else ConnectionError("the consumer discarded its read"))

    def _read_direct(self, conn: _Conn, msg: ShmRead) -> None:
        """A consumer read a request with no claim (its hold word stood throughout): claim it and finish it
        now, so it counts as delivered to that consumer and its blocks are released. A refused claim (another
        consumer's pull, or not this connection's consumer) changes nothing: the request stays as it was."""
        if not conn.address or msg.transport_address != conn.address or msg.consumer != conn.consumer:
            log.warning("node %s: a direct read of %s names another consumer than the connection's",
                        self._node_id, msg.request_id)
            return
        pull = PullRequest(request_id=msg.request_id, transfer_id=msg.transfer_id, consumer=msg.consumer,
                           transport_address=msg.transport_address, dst_block_ids=msg.dst_block_ids,
                           first_block=msg.first_block, src_block_ids=msg.src_block_ids, heads=msg.heads,
                           block_size=msg.block_size)
        job = self.claims.claim(pull)
        if isinstance(job, Refused):
            log.info("request %s: direct read by %s not recorded: %s", msg.request_id, msg.consumer, job.reason)
            return
        job.replied = True
        self.claims.finish(job, None)

    def can_block(self) -> bool:
        """Not for SPIN_S after a claim: the consumer's ShmReadDone then finds us awake (a wake-up costs more
        than a short read here), so the blocks go back without a scheduler round trip."""
        now = time.monotonic()
        return not any(now - at < SPIN_S for conn in self._conns.values() for _, at in conn.reading.values())

    def abandon(self, job: SendJob) -> bool:
        """The job's deadline passed before the consumer said it was done: stop holding it for the read."""
        for conn in self._conns.values():
            conn.reading.pop((job.msg.request_id, job.msg.transfer_id), None)
        return False

    def _send(self, conn: _Conn, msg: Message, fds: Sequence[int] = ()) -> bool:
        try:
            send_msg(conn.sock, msg, fds)
            return True
        except OSError as exc:  # includes a full socket: a consumer that does not read is dropped
            self._drop(conn, f"send failed: {exc}")
            return False

    def _drop(self, conn: _Conn, reason: str) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self._epoll.unregister(fd)
        conn.sock.close()
        for job, _ in conn.reading.values():  # nobody reads them any more
            self.claims.finish(job, ConnectionError(f"consumer connection closed: {reason}"))
        conn.reading.clear()
        log.debug("node %s: connection of consumer %r closed: %s", self._node_id, conn.consumer, reason)
