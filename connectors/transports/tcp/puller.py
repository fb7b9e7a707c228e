"""The consumer's side of a TCP transfer: pull one request's KV into its blocks.

Lifecycle:

1. The puller draws a random token once (its published transport address).
2. The first pull from a producer connects to that producer's data listener, sends HELLO
   with the token and waits for ACK (all bounded by the pull's deadline); the connection
   is then kept for later pulls and checked before each one (a producer that closed it,
   or bytes nobody asked for, mean reconnect).
3. A pull sends its `PullRequest` on the side channel and waits on both the side channel
   (a refusal) and the data socket for the HEADER (checked: magic, transfer id, total
   bytes).
4. It reads the payload with blocking `recvmsg_into` calls bounded by the deadline,
   straight into the destination blocks and hidden tensors; the last byte ends the pull
   (the producer's ok, skipped as stale by a later pull, is not waited for).
5. `close()` closes every connection and the side channel.

On any failure or at the deadline the data connection is closed, so no byte of that
transfer can be read as part of another; only this thread ever writes into the blocks,
and only inside `pull` (a device pool's copies out of the staging buffer are complete
before it returns or raises).
"""

from __future__ import annotations

import itertools
import secrets
import socket
import struct
import time

import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.control.side_channel import SideChannelClient
from kvwire.connectors.transports.kv_region import KVRegion, consumer_stream
from kvwire.connectors.transports.tcp.frames import (
    ACK,
    DATA_MAGIC,
    HEADER,
    HELLO,
    HELLO_MAGIC,
    TOKEN_BYTES,
    parse_address,
    tune,
)
from kvwire.connectors.transports.tcp.stream import ByteStream, Staging
from kvwire.connectors.transports.transport import ConfirmedPulls
from kvwire.connectors.wire import KVLocation, PullRequest


class TCPPuller(ConfirmedPulls):
    def __init__(self, node_id: str, region: KVRegion):
        """Args:
        node_id: this consumer's name in the directory.
        region: the pool's bytes (destination blocks).
        """
        self._node_id = node_id
        self._region = region
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._conns: dict[bytes, socket.socket] = {}  # producer's transport address -> data connection
        self._channel = SideChannelClient()
        self._transfer_ids = itertools.count(1)
        self._staging = Staging()  # pinned memory only once a CUDA destination is met

    @property
    def transport_address(self) -> bytes:
        return self._token

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Receive `loc`'s blocks into `dst_blocks` and its hidden tensors into `hidden`.

        Returns:
            Bytes received.
        Raises:
            TransferError: refused, failed, malformed stream, or not complete by `deadline`.
        """
        try:
            parts, land = consumer_stream(self._region, loc, dst_blocks, hidden)
        except ValueError as exc:
            raise TransferError(loc.request_id, loc.producer, str(exc)) from exc
        transfer_id = next(self._transfer_ids)
        try:
            sock = self._connection(loc, deadline)
            stream = ByteStream(parts, outbound=False, staging=self._staging)
            inbound = _Inbound(loc, sock, transfer_id, stream, deadline)
            self._channel.send(loc.side_channel, PullRequest(
                request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
                transport_address=self._token, dst_block_ids=dst_blocks, first_block=loc.first_block,
                src_block_ids=loc.block_ids, block_size=loc.pull_block_size,
                heads=loc.heads, layer_major=True))
            # Every byte after a header naming this transfer is this transfer's (one stream, in order; the
            # producer never refuses after the header): done is proof enough, the ok is skipped when it comes.
            self._channel.wait(loc, transfer_id, deadline, fds=[sock.fileno()], progress=inbound.progress,
                               done=lambda: inbound.done, reply_needed=False)
            if land is not None:
                land()  # a packed pull's staging into its blocks
        except BaseException as exc:
            self._disconnect(loc.transport_address)
            self._staging.settle()  # no copy into the blocks outlives the failed pull
            if isinstance(exc, (TransferError, KeyboardInterrupt)):
                raise
            raise TransferError(loc.request_id, loc.producer, f"receive failed: {exc}") from exc
        return inbound.total

    def close(self) -> None:
        for address in list(self._conns):
            self._disconnect(address)
        self._channel.close()

    def _connection(self, loc: KVLocation, deadline: float) -> socket.socket:
        sock = self._conns.get(loc.transport_address)
        if sock is not None and _idle_and_open(sock):
            return sock
        self._disconnect(loc.transport_address)
        sock = _connect(loc, self._token, deadline)
        self._conns[loc.transport_address] = sock
        return sock

    def _disconnect(self, address: bytes) -> None:
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()


class _Inbound:
    """One transfer arriving on the data socket: header, then payload.

    The header is read non-blocking from the side channel's wait loop, which also
    watches for a refusal. Once a valid header is in, the producer has committed to
    this transfer (it never refuses after sending) and the payload is read with
    blocking `recvmsg_into(MSG_WAITALL)` calls bounded by SO_RCVTIMEO at the deadline:
    the kernel then fills the blocks with no wake-up per segment.
    """

    def __init__(self, loc: KVLocation, sock: socket.socket, transfer_id: int, stream: ByteStream, deadline: float):
        self._loc, self._sock, self._transfer_id, self._stream = loc, sock, transfer_id, stream
        self._deadline = deadline
        self.total = stream.remaining
        self._header = bytearray(HEADER.size)
        self._header_got = 0

    @property
    def done(self) -> bool:
        return self._header_got == HEADER.size and self._stream.done

    def progress(self) -> None:
        """Read the header if it is there, then the whole payload (bounded by the deadline).

        Raises:
            TransferError: the connection failed or closed, the stream is not this
                transfer, or the payload did not arrive before the deadline.
        """
        if self.done:
            return
        while self._header_got < HEADER.size:
            try:
                n = self._sock.recv_into(memoryview(self._header)[self._header_got:])
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._error(f"data connection failed: {exc}") from exc
            if n == 0:
                raise self._error("producer closed the data connection mid-transfer")
            self._header_got += n
        self._check_header()
        self._read_payload()

    def _read_payload(self) -> None:
        self._sock.setblocking(True)
        try:
            while not self._stream.done:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise self._error("payload did not arrive before the deadline")
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
                try:
                    n = self._sock.recvmsg_into(self._stream.batch(), 0, socket.MSG_WAITALL)[0]
                except BlockingIOError:
                    continue  # SO_RCVTIMEO expired with nothing read: the loop checks the deadline
                except OSError as exc:
                    raise self._error(f"data connection failed: {exc}") from exc
                if n == 0:
                    raise self._error("producer closed the data connection mid-transfer")
                self._stream.advance(n)
        finally:
            self._sock.setblocking(False)

    def _check_header(self) -> None:
        magic, transfer_id, total = HEADER.unpack(self._header)
        if magic != DATA_MAGIC:
            raise self._error(f"bad data header magic {bytes(magic)!r}")
        if transfer_id != self._transfer_id:
            raise self._error(f"data for transfer {transfer_id}, expected {self._transfer_id}")
        if total != self.total:
            raise self._error(f"producer sends {total} bytes, the destination holds {self.total}")

    def _error(self, reason: str) -> TransferError:
        return TransferError(self._loc.request_id, self._loc.producer, reason)


def _timeval(seconds: float) -> bytes:
    """SO_RCVTIMEO's struct timeval, at least 1 ms (zero would mean no timeout at all)."""
    seconds = max(seconds, 1e-3)
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _idle_and_open(sock: socket.socket) -> bool:
    """True when the connection has neither closed nor received unrequested bytes."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def _connect(loc: KVLocation, token: bytes, deadline: float) -> socket.socket:
    """Open a data connection to `loc`'s producer and register `token` there.

    Raises:
        TransferError: bad address, refused, or no ACK before `deadline`.
    """
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(loc.request_id, loc.producer, "deadline passed while connecting")
        return left

    try:
        host, port = parse_address(loc.transport_address)
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (ValueError, OSError) as exc:
        raise TransferError(loc.request_id, loc.producer, f"bad TCP address {loc.transport_address!r}: {exc}") from exc
    try:
        tune(sock)  # before connect: the receive window is negotiated in the SYN
        sock.settimeout(remaining())
        sock.connect(addr)
        sock.settimeout(remaining())
        sock.sendall(HELLO.pack(HELLO_MAGIC, token))
        ack, got = bytearray(len(ACK)), 0
        while got < len(ACK):
            sock.settimeout(remaining())
            n = sock.recv_into(memoryview(ack)[got:])
            if n == 0:
                raise TransferError(loc.request_id, loc.producer, "producer closed the data connection at hello")
            got += n
        if ack != ACK:
            raise TransferError(loc.request_id, loc.producer, f"bad hello acknowledgement {bytes(ack)!r}")
        sock.setblocking(False)
        return sock
    except BaseException as exc:
        sock.close()
        if isinstance(exc, (TransferError, KeyboardInterrupt)):
            raise
        raise TransferError(loc.request_id, loc.producer, f"cannot open the TCP data connection: {exc}") from exc
