"""The directory's node registry: which nodes are alive, the transport addresses consumers receive KV at,
and the transfers counted into each node.

A node's registration passes through these steps:

1. `next_epoch`: each incarnation of a node gets a higher epoch than every earlier one (`claim_node`: only
   while no live server holds the id, checked and taken in one step; `first_epoch`: waiting a while for a Redis
   that does not answer yet, as a starting node does).
2. `register_node`: its NodeInfo goes under a key that lives node_ttl_s.
3. `heartbeat`: a `Heartbeat` thread (connectors/directory/heartbeat.py) rewrites it every node_ttl_s/3.
   Writes from an older incarnation are refused (StaleNodeError).
4. `deregister_node`, or the key's TTL runs out: the node leaves `live_nodes` within node_ttl_s.

Consumer nodes also publish the transport address they receive KV at (`publish_transport_address`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar, cast

import redis
from redis.typing import EncodableT

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.connection import (
    DirectoryConnection,
    DirectoryError,
    StaleNodeError,
    _Fields,
    _ms,
    _timed,
)
from kvwire.connectors.wire import NodeEngine, NodeInfo, WireError, decode, encode
from kvwire.observability.labels import DirectoryOp

logger = logging.getLogger(__name__)
FIRST_PAUSE_S = 0.25  # between a starting node's tries to reach the directory; doubles up to MAX_PAUSE_S
MAX_PAUSE_S = 2.0
T = TypeVar("T")


def _node_info(raw: bytes) -> NodeInfo:
    info = decode(raw, expect=NodeInfo)
    assert isinstance(info, NodeInfo)  # decode rejects every other type
    return info


class NodeRegistry(DirectoryConnection):
    """The node registry's operations (KVDirectory has them; every method raises DirectoryError when Redis cannot
    be reached)."""

    def next_epoch(self, node_id: str) -> int:
        """A new epoch for this incarnation of `node_id`, higher than every earlier one."""
        epoch_key = self._node_keys(node_id)[1]
        with self._errors(f"next_epoch of node {node_id}"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.incr(epoch_key)
            pipe.pexpire(epoch_key, self._epoch_ttl_ms)
            epoch, _ = pipe.execute()
        return int(epoch)

    def first_epoch(self, node_id: str, wait_s: float) -> int:
        """`next_epoch` for a node that is starting, waiting up to `wait_s` for a Redis that does not answer yet
        (`_starting`). Raises DirectoryError past `wait_s`, or at once for an answer that is an error."""
        return self._starting(lambda: self.next_epoch(node_id), node_id, wait_s)

    def first_claim(self, node_id: str, wait_s: float) -> tuple[int, NodeInfo | None]:
        """`claim_node` for a server that is starting, waiting as `first_epoch` does."""
        return self._starting(lambda: self.claim_node(node_id), node_id, wait_s)

    def _starting(self, op: Callable[[], T], node_id: str, wait_s: float) -> T:
        """`op()`, tried again while Redis refuses or times out (started beside the node, or restarting) until
        `wait_s` has passed; logged when the wait begins and when it ends."""
        deadline, pause, waited = time.monotonic() + wait_s, FIRST_PAUSE_S, False
        while True:
            try:
                out = op()
            except DirectoryError as exc:
                if not isinstance(exc.__cause__, (redis.ConnectionError, redis.TimeoutError)):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DirectoryError(f"not answering after {wait_s:g} s: {exc.reason}", peer=self.peer) from exc
                if not waited:
                    logger.warning("%s (node %s waits up to %g s for it)", exc, node_id, wait_s)
                waited = True
                time.sleep(min(pause, left))
                pause = min(2 * pause, MAX_PAUSE_S)
                continue
            if waited:
                logger.warning("directory %s answers; node %s goes on", self.peer, node_id)
            return out

    def claim_node(self, node_id: str) -> tuple[int, NodeInfo | None]:
        """`next_epoch` for a server that must be the only live holder of `node_id`, in one atomic step.

        Refused while a registration that is not draining holds the id, or while another incarnation's claim
        is waiting for its registration (`register_node` ends it; else it lapses after node_ttl_s).

        Returns:
            (the new epoch, None); refused: (0, the live holder's NodeInfo, or None for a claim not yet
            registered).
        """
        holder = self.get_node(node_id)
        if holder is not None and not holder.draining:
            return 0, holder
        keys = [*self._node_keys(node_id), self._claim_key(node_id)]
        args: list[EncodableT] = [_ms(self.node_ttl_s), self._epoch_ttl_ms, "absent" if holder is None else "draining"]
        with self._errors(f"claim node {node_id}"):
            ok, epoch = self._claim_node(keys=keys, args=args)
        return (int(epoch), None) if ok else (0, self.get_node(node_id))

    @property
    def _index_key(self) -> str:
        """The node index: a sorted set of the ids of nodes that wrote their record (scripts.py, LUA_PUT_NODE)."""
        return f"{self.namespace}:nodes"

    def _claim_key(self, node_id: str) -> str:
        return f"{self.namespace}:claim:{node_id}"

    def register_node(self, info: NodeInfo) -> None:
        """Publish the node's NodeInfo for node_ttl_s (ending its `claim_node` claim).

        Raises:
            StaleNodeError: a newer incarnation of the node holds a higher epoch.
        """
        self._write_node(info)
        with self._errors(f"register node {info.node_id}"):
            self._redis.delete(self._claim_key(info.node_id))
        logger.info("node %s registered: role=%s epoch=%d", info.node_id, info.role, info.epoch)

    def heartbeat(self, info: NodeInfo) -> bool:
        """Refresh the node's registration, with its current load, for another node_ttl_s.

        Returns:
            Whether the directory had lost the node's epoch (Redis restarted without its data, or was flushed):
            whatever else the node wrote there is gone too, and the node may write it again.
        Raises:
            StaleNodeError: a newer incarnation of the node holds a higher epoch.
        """
        return self._write_node(info) < info.epoch

    @_timed(DirectoryOp.WRITE_NODE)
    def _write_node(self, info: NodeInfo) -> int:
        """Writes the node's record; returns the epoch the directory held for it before (0: none)."""
        args: list[EncodableT] = [encode(info), info.epoch, _ms(self.node_ttl_s), self._epoch_ttl_ms, info.node_id]
        with self._errors(f"write node {info.node_id}"):
            ok, latest = self._put_node(keys=[*self._node_keys(info.node_id), self._index_key], args=args)
        if not ok:
            reason = f"node {info.node_id} epoch {info.epoch} is older than its latest epoch {latest}"
            raise StaleNodeError(reason, peer=self.peer)
        return int(latest)

    def deregister_node(self, node_id: str) -> None:
        """Remove the node's registration, or its claim where it never registered (its epoch counter stays)."""
        with self._errors(f"deregister node {node_id}"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self._node_keys(node_id)[0], self._claim_key(node_id))
            pipe.zrem(self._index_key, node_id)
            pipe.execute()
        logger.info("node %s deregistered", node_id)

    def get_node(self, node_id: str) -> NodeInfo | None:
        """The node's NodeInfo; None if it is not registered or its TTL ran out.

        Raises:
            DirectoryError: also when the stored record is unreadable.
        """
        with self._errors(f"get node {node_id}"):
            raw = cast(bytes | None, self._redis.get(self._node_keys(node_id)[0]))
        try:
            return None if raw is None else _node_info(raw)
        except WireError as exc:
            raise DirectoryError(f"unreadable record of node {node_id}: {exc}", peer=self.peer) from exc

    @_timed(DirectoryOp.LIVE_NODES)
    def live_nodes(self, role: NodeRole | None = None, *, include_draining: bool = False,
                   engine: NodeEngine | None = NodeEngine.KVWIRE) -> list[NodeInfo]:
        """Registered nodes, of `role` if given, sorted by node_id; unreadable records are skipped. Read from the
        node index: two round trips (three when one expired), however many keys the directory holds.

        Args:
            role: only nodes of this role; every role when None.
            include_draining: also list nodes that are shutting down (they take no new work).
            engine: only nodes behind which this engine serves (kvwire's own, by default: those take
                PrefillWork / DecodeWork); every engine when None.
        """
        with self._errors("live_nodes"):
            ids = [m.decode() for m in cast(list[bytes], self._redis.zrange(self._index_key, 0, -1))]
            raws = cast(list[bytes | None], self._redis.mget([self._node_keys(n)[0] for n in ids])) if ids else []
            gone = [n for n, raw in zip(ids, raws) if raw is None]  # expired (or deregistered) since indexed
            if gone:
                self._redis.zrem(self._index_key, *gone)
        nodes: list[NodeInfo] = []
        for node_id, raw in zip(ids, raws):
            try:
                info = _node_info(raw) if raw is not None else None
            except WireError as exc:
                logger.warning("skipping unreadable record of node %s: %s", node_id, exc)
                continue
            if info is None or (engine is not None and info.engine != engine):
                continue
            if (role is None or info.role == role) and (include_draining or not info.draining):
                nodes.append(info)
        return sorted(nodes, key=lambda n: n.node_id)

    # --- transport addresses ------------------------------------------------------------

    def publish_transport_address(self, node_id: str, kind: ConnectorKind, address: bytes) -> None:
        """Record the address a consumer node receives KV at over transport `kind` (TTL entry_ttl_s).

        Producers send only to the address a node published here, never to one taken
        from a message: UCX aborts the whole process on a malformed worker address.
        """
        with self._errors(f"publish {kind} transport address of {node_id}"):
            self._redis.set(f"{self.namespace}:endpoint:{node_id}:{kind}", address, px=_ms(self.entry_ttl_s))

    @_timed(DirectoryOp.TRANSPORT_ADDRESS_OF)
    def transport_address_of(self, node_id: str, kind: ConnectorKind) -> bytes | None:
        """The address `node_id` published for transport `kind`; None if none is live."""
        with self._errors(f"get {kind} transport address of {node_id}"):
            return cast(bytes | None, self._redis.get(f"{self.namespace}:endpoint:{node_id}:{kind}"))

    @_timed(DirectoryOp.RECORD_TRANSFER)
    def record_transfer(self, node_id: str, transport: ConnectorKind, nbytes: int) -> None:
        """Count a completed transfer into `node_id`, per transport (a hash with the node's TTL x 10)."""
        with self._errors(f"record transfer into {node_id}"):
            pipe = self._redis.pipeline(transaction=False)
            self.queue_record_transfer(pipe, node_id, transport, nbytes)
            pipe.execute()

    def queue_record_transfer(self, pipe: redis.client.Pipeline, node_id: str, transport: ConnectorKind,
                              nbytes: int) -> None:
        """`record_transfer`'s commands, queued on `pipe` (3 replies) for the caller to execute."""
        key = f"{self.namespace}:transfers:{node_id}"
        pipe.hincrby(key, f"{transport}:count", 1)
        pipe.hincrby(key, f"{transport}:bytes", nbytes)
        pipe.pexpire(key, self._epoch_ttl_ms)

    def transfers(self, node_id: str) -> dict[str, int]:
        """`{"<transport>:count": n, "<transport>:bytes": b}` recorded for `node_id`."""
        with self._errors(f"transfers of {node_id}"):
            raw = cast(_Fields, self._redis.hgetall(f"{self.namespace}:transfers:{node_id}"))
        return {k.decode(): int(v) for k, v in raw.items()}
