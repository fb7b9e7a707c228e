"""The producer's TCP send engine: a data listener and non-blocking scatter/gather sends.

Lifecycle:

1. `__init__` binds the data listener on the config host (its `host:port` is the
   transport address the producer publishes) and an epoll set holding it. The transfer
   server's thread runs everything else: it polls the epoll fd (`fds()`) and calls
   `progress()` each turn.
2. `progress()` accepts connections, reads each one's HELLO (bounded by
   HANDSHAKE_TIMEOUT_S) and registers its consumer token, answering ACK.
3. `start(job)` queues a granted pull on the connection that presented the pull's token.
4. `progress()` writes HEADER + pieces with `sendmsg` whenever the socket has room. A
   layer-wise request's stream goes no further than its gate allows, nor does the staging
   of its device pieces read further (connectors/producer/layer_gate.py): the header at
   once, then each layer once the prefill forward has written it, the hidden states last;
   a connection waiting on a gate is pumped again on each `progress()` (the gate wakes the
   server) and dropped if the forward fails.
5. `server.finish(job, None)` once the kernel holds the last byte (it copied them, so the
   blocks may be reused at once).
6. `close()` closes every socket.

A connection that errors, closes, sends anything after its hello, or is replaced by a
newer one from the same token is closed and its queued jobs finish with a TransferError;
the next pull reconnects. `abandon(job)` stops writing the job at once (closing the
connection if the job was half sent, since its stream cannot be resumed).

Single-threaded by construction (all calls come from the server thread): no locks.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import time
from dataclasses import dataclass, field

from kvwire.connectors.base import TransferError
from kvwire.connectors.transports.tcp.frames import (
    ACK,
    DATA_MAGIC,
    HEADER,
    HELLO,
    HELLO_MAGIC,
    SOCKET_BUFFER_BYTES,
    encode_address,
    tune,
)
from kvwire.connectors.transports.tcp.stream import ByteStream, Staging
from kvwire.connectors.transports.transport import SendEngine, SendJob

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not said HELLO by then is closed
MAX_CONNECTIONS = 256  # consumers are a handful of decode processes; bounds fds and memory
TURN_BUDGET_BYTES = 64 << 20  # per connection per progress() call, so the server loop stays responsive
# A non-blocking send takes at most the free socket buffer (the kernel grants twice the
# size asked): offering far more only costs a buffer lookup per extra piece.
SEND_BATCH_BYTES = 2 * SOCKET_BUFFER_BYTES


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float  # for the handshake
    token: bytes | None = None  # set once the HELLO is read
    hello: bytearray = field(default_factory=lambda: bytearray(HELLO.size))
    hello_got: int = 0
    jobs: collections.deque[SendJob] = field(default_factory=collections.deque)
    staging: Staging = field(default_factory=Staging)  # pinned memory only once a CUDA piece is sent

    def name(self) -> str:
        return f"{self.peer} ({self.token.hex()[:8] if self.token else 'no hello yet'})"


@dataclass(eq=False)
class _Sending:
    conn: _Conn
    stream: ByteStream
    total: int  # bytes of the stream, header included

    def sendable(self, job: SendJob) -> int:
        """Bytes that may go now: all of them, or for a layer-wise request up to the end of its last
        computed layer (the hidden states once the gate is complete)."""
        gate = job.held.gate
        if gate is None or gate.complete_and_ready:
            return self.stream.remaining
        allowed = HEADER.size + job.layer_nbytes * gate.ready_layers()
        return max(0, allowed - (self.total - self.stream.remaining))


class TCPSendEngine(SendEngine):
    def __init__(self, host: str, advertise_host: str | None = None):
        """Args:
        host: address the data listener binds (a port is picked).
        advertise_host: the address consumers connect to (the transport address); None: host.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune(self._listener)  # accepted sockets inherit the buffer sizes (they must be set before the SYN)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.transport_address = encode_address(advertise_host or host, self._listener.getsockname()[1])
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._conns: dict[int, _Conn] = {}
        self._by_token: dict[bytes, _Conn] = {}
        self._gated: set[_Conn] = set()  # connections whose next job waits for its prefill's next layer

    streams_layers = True

    # --- SendEngine --------------------------------------------------------------------

    def fds(self) -> list[int]:
        return [self._epoll.fileno()]

    def progress(self) -> bool:
        ready = self._epoll.poll(0)
        for fd, events in ready:
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._conns:
                self._on_event(self._conns[fd], events)
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.token is None and c.deadline <= now]:
            self._drop(conn, "no hello before the handshake timeout")
        for conn in list(self._gated):  # a gate may have opened (its waker woke the server loop)
            self._pump(conn)
        return bool(ready)

    def can_block(self) -> bool:
        return not any(c.jobs and c.jobs[0].held.gate and c.jobs[0].held.gate.needs_polling() for c in self._gated)

    def start(self, job: SendJob) -> None:
        """Queue `job` on its consumer's data connection and start writing it.

        Raises:
            TransferError: that consumer has no data connection here.
        """
        msg = job.msg
        conn = self._by_token.get(msg.transport_address)
        if conn is None:
            raise TransferError(msg.request_id, msg.consumer, "consumer has no TCP data connection to this producer")
        header = memoryview(HEADER.pack(DATA_MAGIC, msg.transfer_id, job.nbytes))
        stream = ByteStream([header, *job.stream_parts()], outbound=True, staging=conn.staging)
        job.state = _Sending(conn, stream, stream.remaining)
        conn.jobs.append(job)
        if len(conn.jobs) == 1:
            self._pump(conn)

    def abandon(self, job: SendJob) -> bool:
        sending = job.state
        if not isinstance(sending, _Sending) or job not in sending.conn.jobs:
            return False
        conn = sending.conn
        half_sent = conn.jobs[0] is job and sending.stream.moved_any
        conn.jobs.remove(job)
        if half_sent:
            self._drop(conn, f"pull of {job.msg.request_id} abandoned half sent")
        else:
            self._watch(conn)
        return False

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._forget(conn)
        self._listener.close()
        self._epoll.close()

    # --- connections -------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. EMFILE: leave the rest in the backlog for later
                log.warning("TCP data listener %s: accept failed: %s", self.transport_address.decode(), exc)
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                log.warning("TCP data listener: refusing %s: %d connections open", addr, len(self._conns))
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + HANDSHAKE_TIMEOUT_S)
            self._conns[sock.fileno()] = conn
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _on_event(self, conn: _Conn, events: int) -> None:
        if conn.token is None:
            self._read_hello(conn)
            return
        if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
            reason = self._why_readable(conn)
            if reason is not None:
                self._drop(conn, reason)
                return
        if events & select.EPOLLOUT:
            self._pump(conn)

    def _read_hello(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(memoryview(conn.hello)[conn.hello_got:])
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(conn, f"handshake failed: {exc}")
            return
        if n == 0:
            self._drop(conn, "closed during the handshake")
            return
        conn.hello_got += n
        if conn.hello_got == HELLO.size:
            self._register(conn)

    def _register(self, conn: _Conn) -> None:
        """A whole HELLO is in: bind the connection to its token and acknowledge."""
        magic, token = HELLO.unpack(conn.hello)
        if magic != HELLO_MAGIC:
            self._drop(conn, f"bad hello magic {magic!r}")
            return
        previous = self._by_token.get(token)
        if previous is not None:
            self._drop(previous, "replaced by a newer connection from the same consumer")
        conn.token = token
        self._by_token[token] = conn
        try:
            sent = conn.sock.send(ACK)  # 8 bytes into an empty socket buffer: all of them or an error
        except OSError as exc:
            self._drop(conn, f"cannot acknowledge the hello: {exc}")
            return
        if sent != len(ACK):
            self._drop(conn, "cannot acknowledge the hello: short write")
            return
        log.info("TCP data connection from consumer %s", conn.name())

    def _why_readable(self, conn: _Conn) -> str | None:
        """A consumer never writes after its hello: readable means closed, failed, or misbehaving."""
        try:
            data = conn.sock.recv(1)
        except BlockingIOError:
            return None
        except OSError as exc:
            return f"connection failed: {exc}"
        return "consumer closed the connection" if not data else "consumer sent bytes after its hello"

    # --- sending -----------------------------------------------------------------------

    def _pump(self, conn: _Conn) -> None:
        """Write the connection's queued jobs until the socket is full or the turn budget is spent."""
        budget = TURN_BUDGET_BYTES
        self._gated.discard(conn)
        while conn.jobs and budget > 0:
            job = conn.jobs[0]
            sending = job.state
            assert isinstance(sending, _Sending)  # set by start()
            stream = sending.stream
            if job.held.gate is not None and job.held.gate.failure:
                self._drop(conn, f"prefill of {job.msg.request_id} failed: {job.held.gate.failure}")
                return
            sendable = sending.sendable(job)
            if sendable == 0:
                self._gated.add(conn)  # the next layer's gate wakes the server, whose progress() pumps again
                break
            try:
                n = conn.sock.sendmsg(stream.batch(max_bytes=SEND_BATCH_BYTES, limit=sendable))
            except BlockingIOError:
                break
            except Exception as exc:  # noqa: BLE001 - socket or staging copy failed: fail this connection only
                self._drop(conn, f"send failed: {exc}")
                return
            stream.advance(n)
            budget -= n
            if stream.done:
                conn.jobs.popleft()
                self.claims.finish(job, None)
        self._watch(conn)

    def _watch(self, conn: _Conn) -> None:
        """Wake for writability only while the connection has something it may send."""
        events = select.EPOLLIN | (select.EPOLLOUT if conn.jobs and conn not in self._gated else 0)
        self._epoll.modify(conn.sock.fileno(), events)

    def _drop(self, conn: _Conn, reason: str) -> None:
        log.warning("TCP data connection %s closed: %s", conn.name(), reason)
        jobs = list(conn.jobs)
        self._forget(conn)
        for job in jobs:
            error = TransferError(job.msg.request_id, job.msg.consumer, f"TCP data connection: {reason}")
            self.claims.finish(job, error)

    def _forget(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is not None:
            self._epoll.unregister(fd)
        if conn.token is not None and self._by_token.get(conn.token) is conn:
            del self._by_token[conn.token]
        conn.jobs.clear()
        self._gated.discard(conn)
        conn.sock.close()
