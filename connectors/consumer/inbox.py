"""A consumer's inbox: producers tell it directly where a request's KV is (`KVReady`).

Lifecycle:

1. Opened by a consumer that is told directly (a decode node's): a zmq PULL socket bound
   on the connector's host, any port. Its `endpoint` goes into the node's registry record
   (`NodeInfo.kv_ready_endpoint`); a router names it in `PrefillWork`, and the prefill
   node's producer pushes the `KVReady` there once the KV is held.
2. The owner's loop polls `socket` with its own sockets; the consumer's `ready()` takes
   what came (`take`, never blocking), on the owner's thread: no thread between the
   producer's message and the pull that it starts.
3. A message that is not a valid `KVReady` (or fails the seal) is counted as rejected
   and dropped; the directory's READY still settles its request.
4. `close()` with the consumer.
"""

from __future__ import annotations

import logging

import zmq

from kvwire.connectors.config import ConnectorConfig
from kvwire.connectors.control.auth import AuthError
from kvwire.connectors.control.framing import unpack
from kvwire.connectors.control.sockets import limit_receive
from kvwire.connectors.wire import KVLocation, KVReady, WireError
from kvwire.observability.labels import RejectReason
from kvwire.observability.metrics import Metrics

log = logging.getLogger(__name__)

MAX_TAKE = 256  # messages read per `take`: the owner's loop gets back to its engine between batches


class Inbox:
    def __init__(self, config: ConnectorConfig, metrics: Metrics):
        self._node = config.node_id
        self._metrics = metrics
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        limit_receive(self.socket)
        port: int = self.socket.bind_to_random_port(f"tcp://{config.host}")
        self.endpoint = f"tcp://{config.advertised_host}:{port}"  # what producers push to

    def take(self) -> list[KVLocation]:
        """The locations that came since the last call (at most MAX_TAKE), without waiting."""
        got: list[KVLocation] = []
        while len(got) < MAX_TAKE:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                got.append(unpack(frame.buffer, expect=KVReady).location)
            except WireError as exc:
                if not isinstance(exc, AuthError):  # auth counts its own rejections
                    self._metrics.messages_rejected.labels(str(RejectReason.MALFORMED)).inc()
                log.warning("node %s: rejected a message on its KVReady inbox: %s", self._node, exc)
        return got

    def close(self) -> None:
        self.socket.close(linger=0)
