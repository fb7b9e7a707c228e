"""The control plane's zmq sockets: one cache of PUSH sockets, one size limit for every receiver.

Routers push work to nodes, prefill nodes push `KVReady` to decode nodes, decode nodes push
tokens to routers, and draining nodes forward work: each keeps a `PushSockets`, so every
control message leaves with the same linger and high-water mark. Every socket that
receives control messages takes `limit_receive`, the size `unpack` accepts plus a seal.
"""

from __future__ import annotations

import zmq

from kvwire.connectors.control.auth import SEAL_BYTES
from kvwire.connectors.control.framing import pack
from kvwire.connectors.wire import MAX_MESSAGE_BYTES, AnyMessage

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + SEAL_BYTES
LINGER_MS = 1000  # what is queued still goes out as the process exits (a decode node's last chunks)
SNDHWM = 100_000  # messages queued per peer before a send blocks (or fails, when it may not block)
MAX_PEERS = 64  # endpoints kept open; peers come and go, so past this the cache starts over


def limit_receive(sock: zmq.Socket) -> None:
    """Refuse frames larger than any valid control message before reading them."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)


class PushSockets:
    """PUSH sockets to other processes' control endpoints, connected on first use and kept.

    Owned by one thread (or one asyncio loop, when built on a `zmq.asyncio.Context`).
    """

    def __init__(self, context: zmq.Context | None = None, max_peers: int = MAX_PEERS):
        self._ctx = context or zmq.Context.instance()
        self._max_peers = max_peers
        self._sockets: dict[str, zmq.Socket] = {}

    def get(self, endpoint: str) -> zmq.Socket:
        """The socket to `endpoint` (a zmq URL).

        Raises:
            zmq.ZMQError: the endpoint is malformed.
        """
        sock = self._sockets.get(endpoint)
        if sock is None:
            if len(self._sockets) >= self._max_peers:
                self.close()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.close(0)
                raise
            self._sockets[endpoint] = sock
        return sock

    def send(self, endpoint: str, msg: AnyMessage, *, block: bool = True) -> None:
        """Pack `msg` and queue it for `endpoint`.

        Raises:
            zmq.ZMQError: a malformed endpoint; zmq.Again when `block` is False and the peer's queue is full.
        """
        self.get(endpoint).send(pack(msg), 0 if block else zmq.NOBLOCK)

    def close(self) -> None:
        """Close every socket, each with its linger: what is queued still goes out."""
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
