"""The consumer's end of producers' side channels: zmq DEALER sockets, one per producer.

Owned by the thread that pulls (a decode node's pull thread). `wait` blocks on the
socket and on any transport file descriptors (a TCP data connection, NCCL's wake-up) until the
producer's reply has come and the transport says its part is done, or the deadline
passes; a transport that must be polled (UCX) is spun on instead, napping once nothing
moves (connectors/spin.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import zmq

from kvwire.connectors.base import TransferError
from kvwire.connectors.control.auth import AuthError
from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.control.sockets import limit_receive
from kvwire.connectors.spin import Spin
from kvwire.connectors.wire import KVLocation, Message, PullReply, WireError

log = logging.getLogger(__name__)


class SideChannelClient:
    def __init__(self) -> None:
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, msg: Message) -> None:
        self._socket(endpoint).send(pack(msg))

    def wait(self, loc: KVLocation, transfer_id: int, deadline: float, *, fds: Sequence[int] = (),
             progress: Callable[[], bool | None] = lambda: None, can_block: Callable[[], bool] = lambda: True,
             done: Callable[[], bool] = lambda: True, reply_needed: bool = True) -> None:
        """Block until `done()` holds and, if `reply_needed`, the producer's ok for `transfer_id` has come.

        A transport that must be polled (`can_block` False) is spun on: `progress` returns whether anything
        moved, and once nothing has for a while the spin naps between polls (connectors/spin.py).

        A transport whose bytes can only have come from the producer's own sends of this
        transfer (UCX: tag-matched receives) passes `reply_needed=False`: its done is proof
        enough, and the ok, when it comes, is skipped by a later wait as a stale reply.
        Raises:
            TransferError: the producer refused, or the deadline passed.
        """
        sock = self._socket(loc.side_channel)
        poller = zmq.Poller()
        for fd in [sock, *fds]:
            poller.register(fd, zmq.POLLIN)
        confirmed = False
        spin = Spin()
        while True:
            moved = bool(progress())
            while sock.poll(0):
                confirmed |= self._read_reply(loc, sock, transfer_id)
                moved = True
            if (confirmed or not reply_needed) and done():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(loc.request_id, loc.producer, "transfer did not complete before the deadline")
            if can_block():
                poller.poll(int(remaining * 1000) + 1)
                spin.reset()
            else:
                spin.pause(moved)

    def drop(self, endpoint: str) -> None:
        """Forget a socket that may still receive a stale reply."""
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for endpoint in list(self._sockets):
            self.drop(endpoint)

    def _read_reply(self, loc: KVLocation, sock: zmq.Socket, transfer_id: int) -> bool:
        """Raises TransferError for a refusal, or a reply whose seal does not hold: the producer is the only one
        that answers on this socket, so its secret is not ours (or one side has none), and no pull will pass."""
        try:
            reply = unpack(sock.recv(copy=False).buffer, expect=PullReply)
        except AuthError as exc:
            raise TransferError(loc.request_id, loc.producer, f"the producer's reply does not carry this server's "
                                f"seal ({exc}): the two servers' auth secrets differ") from None
        except WireError as exc:
            log.warning("request %s: bad reply from producer %s: %s", loc.request_id, loc.producer, exc)
            return False
        if reply.transfer_id != transfer_id:
            return False  # a late reply to an abandoned transfer
        if not reply.ok:
            raise TransferError(loc.request_id, loc.producer, f"producer refused: {reply.reason}")
        return True

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            limit_receive(sock)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock
