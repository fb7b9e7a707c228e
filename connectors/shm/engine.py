"""The producer's shared-memory send engine: consumers read the pool, we only grant and confirm.

Lifecycle: `__init__` removes the sockets of dead incarnations of this node, listens on
this incarnation's Unix socket (its path is our transport address) and watches it
with an epoll set whose fd the transfer server polls, so everything below runs on the
server thread. A consumer connects and says `ShmHello`; we answer `ShmSegment` with
the pool's read-only memfd (or CUDA IPC handle). For each pull the server accepts,
`start` grants it (the consumer now reads the blocks itself) and remembers the job.
The consumer then sends `PullDone` on this socket; if the job is still granted we
answer `PullReply(ok)` with the hidden states in a sealed memfd and finish the job,
which releases the blocks. A job whose deadline passes is abandoned first: its late
`PullDone` is answered not-ok, so the consumer discards what it read (the blocks may
already have been reused). A consumer that disconnects finishes its granted jobs as
failed at once. `close()` closes every connection and removes the socket file.
"""

from __future__ import annotations

import logging
import os
import select
import socket
from dataclasses import dataclass
from pathlib import Path

from connectors.shm.channel import (SOCKET_ROOT, close_fds, listen, peer_cred, recv_msg, remove_stale, send_msg,
                                    socket_dir, socket_path)
from connectors.shm.segment import PoolSegment, pack_tensors
from connectors.transfer_server import SendEngine, SendJob
from connectors.wire import Message, PullDone, PullReply, ShmHello, WireError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    consumer: str = ""  # set by ShmHello
    address: bytes = b""  # the consumer's published transport address, set by ShmHello


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
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._conns: dict[int, _Conn] = {}
        self._granted: dict[tuple[str, int], SendJob] = {}

    def fds(self) -> list[int]:
        return [self._epoll.fileno()]  # readable while any of our sockets is

    def progress(self) -> None:
        for fd, _ in self._epoll.poll(0):
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._conns:
                self._serve(self._conns[fd])

    def start(self, job: SendJob) -> None:
        if not any(c.address == job.msg.transport_address for c in self._conns.values()):
            raise ConnectionError(f"consumer {job.msg.consumer} has not mapped this producer's pool")
        self._segment.sync()
        self._granted[(job.msg.request_id, job.msg.transfer_id)] = job
        self.server.grant(job)

    def abandon(self, job: SendJob) -> None:
        self._granted.pop((job.msg.request_id, job.msg.transfer_id), None)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, "producer closing")
        self._epoll.close()
        self._listener.close()
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
                msg, fds = recv_msg(conn.sock, expect=(ShmHello, PullDone))
            except BlockingIOError:
                return
            except (OSError, WireError) as exc:
                self._drop(conn, str(exc))
                return
            close_fds(fds)  # consumers have nothing to send us by descriptor
            if isinstance(msg, ShmHello):
                self._hello(conn, msg)
            else:
                self._done(conn, msg)

    def _hello(self, conn: _Conn, msg: ShmHello) -> None:
        if conn.address:
            self._drop(conn, "second hello")
            return
        conn.consumer, conn.address = msg.consumer, msg.transport_address
        segment, fds = self._segment.export()
        self._send(conn, segment, fds)
        log.debug("node %s: consumer %s (pid %d) mapped the pool", self._node_id, msg.consumer, conn.pid)

    def _done(self, conn: _Conn, msg: PullDone) -> None:
        key = (msg.request_id, msg.transfer_id)
        job = self._granted.get(key)
        if job is None or not conn.address or job.msg.transport_address != conn.address:
            self._send(conn, PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=False,
                                       reason="no granted pull: its deadline passed, or it is not yours"))
            return
        del self._granted[key]
        try:
            fd = pack_tensors(job.held.hidden)
        except OSError as exc:
            self._send(conn, PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=False,
                                       reason=f"cannot hand over the hidden states: {exc}"))
            self.server.finish(job, exc)
            return
        try:
            sent = self._send(conn, PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=True),
                              [] if fd is None else [fd])
        finally:
            if fd is not None:
                close_fds([fd])
        self.server.finish(job, None if sent else ConnectionError("consumer gone before the confirmation"))

    def _send(self, conn: _Conn, msg: Message, fds: list[int] = ()) -> bool:
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
        log.debug("node %s: connection of consumer %r closed: %s", self._node_id, conn.consumer, reason)
        if not conn.address or any(c.address == conn.address for c in self._conns.values()):
            return
        for key, job in list(self._granted.items()):
            if job.msg.transport_address == conn.address:
                del self._granted[key]
                self.server.finish(job, ConnectionError(f"consumer {conn.consumer} disconnected: {reason}"))
