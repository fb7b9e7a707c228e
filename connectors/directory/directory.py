"""The Redis-backed directory: where each request's KV lives, and which nodes are alive.

A request's entry is a Redis hash (every key has a TTL) that passes through these states:

1. absent: nothing recorded yet.
2. PENDING: the producer has scheduled the request (`create_pending`).
3. READY: the KV is in place and the entry holds its KVLocation (`publish_ready`, which also
   accepts an absent entry). The consumer, waiting with `wait_for`, pulls the KV.
4. CONSUMED: the producer has confirmed the pull; it moves the entry here and deletes it.

From PENDING or READY an entry may instead end FAILED (`fail`: either side gives up, with a
reason) or EXPIRED (its producer, once the hold deadline passed unpulled). CONSUMED, FAILED and
EXPIRED are terminal. Each change is one Lua script (compare-and-set) that also refreshes the
TTLs and appends the new state to the request's event stream, which `wait_for` blocks on (the
READY event carries the location, so a woken waiter needs no second read). Whatever nobody
cleans up vanishes after entry_ttl_s.

A node's registration passes through these steps:

1. `next_epoch`: each incarnation of a node gets a higher epoch than every earlier one (`claim_node`: only
   while no live server holds the id, checked and taken in one step).
2. `register_node`: its NodeInfo goes under a key that lives node_ttl_s.
3. `heartbeat`: a `Heartbeat` thread (connectors/directory/heartbeat.py) rewrites it every node_ttl_s/3.
   Writes from an older incarnation are refused (StaleNodeError).
4. `deregister_node`, or the key's TTL runs out: the node leaves `live_nodes` within node_ttl_s.

Consumer nodes also publish the transport address they receive KV at (`publish_transport_address`).

The connection pools do not decode replies, so every reply holds bytes; redis-py's annotations
also allow str (a client made with decode_responses=True), hence the casts to `_Fields` and bytes.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.typing import EncodableT, KeyT, StreamIdT

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory import redis_url as redis_url_forms
from kvwire.connectors.directory.scripts import (
    EVENTS_MAXLEN,
    LUA_CLAIM_NODE,
    LUA_CREATE,
    LUA_PUBLISH,
    LUA_PUT_NODE,
    LUA_TRANSITION,
)
from kvwire.connectors.wire import KVLocation, NodeEngine, NodeInfo, WireError, decode, encode
from kvwire.observability.labels import DirectoryOp
from kvwire.observability.metrics import Metrics, process_metrics

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 5.0  # socket timeout of ordinary commands, by default
_BLOCK_SLICE_S = 5.0  # longest single blocking read; longer waits loop
_MAX_CONNECTIONS = 64
_MAX_BLOCKING_CONNECTIONS = 256  # one per concurrent wait_for
_EPOCH_TTL_FACTOR = 10  # an epoch counter outlives every record that names an older epoch
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]+")

_Fields = dict[bytes, bytes]  # a hash's fields, or a stream event's
_StreamEntry = tuple[bytes, _Fields]  # (event id, fields)


class TransferState(enum.StrEnum):
    PENDING = "pending"
    READY = "ready"
    CONSUMED = "consumed"
    FAILED = "failed"
    EXPIRED = "expired"


TERMINAL_STATES = frozenset({TransferState.CONSUMED, TransferState.FAILED, TransferState.EXPIRED})
LEGAL_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.READY, TransferState.FAILED, TransferState.EXPIRED}),
    TransferState.READY: frozenset({TransferState.CONSUMED, TransferState.FAILED, TransferState.EXPIRED}),
    **{state: frozenset() for state in TERMINAL_STATES},
}


@dataclass(frozen=True)
class DirectoryEntry:
    """One request's entry; `location` is set once it has been READY."""

    request_id: str
    state: TransferState
    producer: str
    location: KVLocation | None
    reason: str


class AgedEntry(NamedTuple):
    entry: DirectoryEntry
    age_s: float  # since the entry was created, by the Redis server's clock


class Watched(NamedTuple):
    """What `look` or `wait_events` saw of one request."""

    entry: DirectoryEntry | None  # None: no entry (look), or no READY event among the new ones (wait_events)
    cursor: bytes  # the id of its newest event: wait after it
    error: str = ""  # its entry could not be read (then `entry` is None)


class Wake(NamedTuple):
    """A stream that ends a blocked `wait_events` when written (`wake`), and the id read up to."""

    key: str
    cursor: bytes


class DirectoryError(RuntimeError):
    """The directory could not be reached, or holds a record it cannot read.

    Attributes:
        reason: what went wrong.
        request_id: the request concerned; None for registry operations.
        peer: the Redis URL, password masked.
    """

    def __init__(self, reason: str, *, request_id: str | None = None, peer: str):
        about = f" request {request_id}" if request_id is not None else ""
        super().__init__(f"directory {peer}{about}: {reason}")
        self.reason = reason
        self.request_id = request_id
        self.peer = peer


class StaleNodeError(DirectoryError):
    """A node wrote its NodeInfo with an epoch older than its node id's latest one."""


def _masked(url: str) -> str:
    return redis_url_forms.masked(url)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _location(raw: bytes) -> KVLocation:
    location = decode(raw, expect=KVLocation)
    assert isinstance(location, KVLocation)  # decode rejects every other type
    return location


def _node_info(raw: bytes) -> NodeInfo:
    info = decode(raw, expect=NodeInfo)
    assert isinstance(info, NodeInfo)  # decode rejects every other type
    return info


def _timed(op: DirectoryOp):
    """Record the method's duration in kvwire_directory_op_seconds{op}, failures included."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self: KVDirectory, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._op_seconds.labels(str(op)).observe(time.perf_counter() - start)
        return timed
    return wrap


class KVDirectory:
    """Client of the directory; thread-safe, one per process is enough.

    Every method raises DirectoryError when Redis cannot be reached.

    Args:
        redis_url: `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS) or
            `redis+sentinel://...` (connectors/directory/redis_url.py; docs/redis.md).
        entry_ttl_s: TTL of a request's keys, refreshed on every transition.
        node_ttl_s: TTL of a node's registration, refreshed by each heartbeat.
        namespace: prefix of every key, so deployments can share one Redis.
        command_timeout_s: how long one command may wait on a silent Redis before it raises DirectoryError
            (and a connection attempt; a blocking read waits its block on top).
        metrics: where operation latencies go; this process's metrics by default.
    Raises:
        ValueError: a non-positive TTL or timeout, or a namespace outside [A-Za-z0-9_.-].
    """

    def __init__(self, redis_url: str, *, entry_ttl_s: float = 60.0, node_ttl_s: float = 5.0,
                 namespace: str = "kvwire", command_timeout_s: float = COMMAND_TIMEOUT_S,
                 metrics: Metrics | None = None):  # fmt: skip
        if entry_ttl_s <= 0 or node_ttl_s <= 0 or command_timeout_s <= 0:
            raise ValueError(f"TTLs and timeouts must be positive, got entry {entry_ttl_s}, node {node_ttl_s}, "
                             f"command {command_timeout_s}")
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE_RE.pattern}")
        self.entry_ttl_s, self.node_ttl_s, self.namespace = entry_ttl_s, node_ttl_s, namespace
        self.peer = _masked(redis_url)
        self._op_seconds = (metrics or process_metrics()).directory_op_seconds
        self._epoch_ttl_ms = _ms(_EPOCH_TTL_FACTOR * max(entry_ttl_s, node_ttl_s))
        # One retry without backoff replaces a pooled connection broken by a server restart,
        # yet fails fast while the server is down.
        common = dict(retry=Retry(NoBackoff(), 1), socket_connect_timeout=command_timeout_s)
        self._pool = redis_url_forms.connection_pool(
            redis_url, max_connections=_MAX_CONNECTIONS, socket_timeout=command_timeout_s, **common)
        # Blocking reads hold a connection for their whole wait: a pool of their own, whose
        # socket timeout exceeds the longest block.
        self._blocking_pool = redis_url_forms.connection_pool(
            redis_url, max_connections=_MAX_BLOCKING_CONNECTIONS,
            socket_timeout=_BLOCK_SLICE_S + command_timeout_s, **common)  # fmt: skip
        self._redis = redis.Redis(connection_pool=self._pool)
        self._blocking = redis.Redis(connection_pool=self._blocking_pool)
        self._create = self._redis.register_script(LUA_CREATE)
        self._publish = self._redis.register_script(LUA_PUBLISH)
        self._transition = self._redis.register_script(LUA_TRANSITION)
        self._put_node = self._redis.register_script(LUA_PUT_NODE)
        self._claim_node = self._redis.register_script(LUA_CLAIM_NODE)
        self._load_scripts()

    def _load_scripts(self) -> None:
        """Load the scripts now (one round trip), so pipelined EVALSHAs find them; best effort: a server
        that is down, or forgets them later, answers NOSCRIPT and the step is re-run (batch.py)."""
        scripts = (self._create, self._publish, self._transition, self._put_node, self._claim_node)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for script in scripts:
                pipe.script_load(script.script)
            pipe.execute()
        except redis.RedisError as exc:
            logger.debug("directory %s: scripts not loaded yet: %s", self.peer, exc)

    def _entry_keys(self, request_id: str) -> list[str]:
        return [f"{self.namespace}:req:{request_id}", f"{self.namespace}:ev:{request_id}"]

    def _node_keys(self, node_id: str) -> list[str]:
        return [f"{self.namespace}:node:{node_id}", f"{self.namespace}:epoch:{node_id}"]

    @contextlib.contextmanager
    def _errors(self, what: str, request_id: str | None = None) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            reason = f"{what}: {type(exc).__name__}: {exc}"
            raise DirectoryError(reason, request_id=request_id, peer=self.peer) from exc

    # --- request entries -------------------------------------------------------------------

    @_timed(DirectoryOp.CREATE_PENDING)
    def create_pending(self, request_id: str, producer: str) -> bool:
        """Create the request's entry in PENDING unless it exists.

        Returns:
            True if created; False if an entry (in any state) was already there.
        """
        with self._errors("create_pending", request_id):
            ok = self._create(keys=self._entry_keys(request_id), args=[producer, _ms(self.entry_ttl_s)])
        logger.debug("request_id=%s create_pending producer=%s ok=%s", request_id, producer, bool(ok))
        return bool(ok)

    @_timed(DirectoryOp.PUBLISH_READY)
    def publish_ready(self, location: KVLocation) -> bool:
        """Move the request to READY (from PENDING or absent), storing where its KV lives.

        Returns:
            True if published; False if the entry is in any state but PENDING.
        Raises:
            StaleNodeError: a newer incarnation of the producer has registered (its epoch is
                higher than `location.producer_epoch`): this process is fenced off.
        """
        rid = location.request_id
        args: list[EncodableT] = [location.producer, encode(location), _ms(self.entry_ttl_s), location.producer_epoch]
        keys = [*self._entry_keys(rid), self._node_keys(location.producer)[1]]
        with self._errors("publish_ready", rid):
            ok = self._publish(keys=keys, args=args)
        logger.debug("request_id=%s publish_ready producer=%s ok=%s", rid, location.producer, ok)
        if ok == -1:
            raise StaleNodeError(f"epoch {location.producer_epoch} of {location.producer} is stale; a newer "
                                 "incarnation registered", request_id=rid, peer=self.peer)
        return bool(ok)

    @_timed(DirectoryOp.TRANSITION)
    def transition(self, request_id: str, allowed_from: Iterable[TransferState], to: TransferState,
                   reason: str = "") -> bool:  # fmt: skip
        """Compare-and-set: move the entry to `to` if its state is one of `allowed_from`.

        Args:
            allowed_from: states the entry may be in; every edge from them to `to` must be legal.
            to: the new state; READY only through `publish_ready`, which stores the location.
            reason: why (a failure's cause), stored with the entry.
        Returns:
            True if the state changed; False if the entry is absent or in another state.
        Raises:
            ValueError: `allowed_from` is empty, an edge is illegal, or `to` is READY.
        """
        sources, to = sorted({TransferState(s) for s in allowed_from}), TransferState(to)
        if not sources:
            raise ValueError(f"request {request_id}: allowed_from is empty")
        if to is TransferState.READY:
            raise ValueError(f"request {request_id}: use publish_ready to reach READY")
        for src in sources:
            if to not in LEGAL_TRANSITIONS[src]:
                raise ValueError(f"request {request_id}: illegal transition {src} -> {to}")
        with self._errors("transition", request_id):
            ok = self._transition(keys=self._entry_keys(request_id),
                                  args=[to, _ms(self.entry_ttl_s), reason, *sources])  # fmt: skip
        logger.debug("request_id=%s transition %s -> %s ok=%s reason=%r", request_id, sources, to, bool(ok), reason)
        return bool(ok)

    @_timed(DirectoryOp.GET)
    def get(self, request_id: str) -> DirectoryEntry | None:
        """The request's entry; None if absent (never created, deleted or expired).

        Raises:
            DirectoryError: also when the stored record is unreadable.
        """
        with self._errors("get", request_id):
            fields = cast(_Fields, self._redis.hgetall(self._entry_keys(request_id)[0]))
        return self._parse_entry(request_id, fields)

    def _parse_entry(self, request_id: str, fields: _Fields) -> DirectoryEntry | None:
        if not fields:
            return None
        try:
            raw_location = fields.get(b"location")
            return DirectoryEntry(
                request_id=request_id,
                state=TransferState(fields[b"state"].decode()),
                producer=fields.get(b"producer", b"").decode(),
                location=_location(raw_location) if raw_location else None,
                reason=fields.get(b"reason", b"").decode(),
            )
        except (WireError, ValueError, KeyError) as exc:
            raise DirectoryError(f"unreadable entry: {exc!r}", request_id=request_id, peer=self.peer) from exc

    @_timed(DirectoryOp.WAIT_FOR)
    def wait_for(self, request_id: str, states: Iterable[TransferState], deadline: float) -> DirectoryEntry | None:
        """Block until the entry is in one of `states` or terminal, or until the deadline.

        Args:
            states: the states awaited.
            deadline: a `time.monotonic()` value; one already past means "look once".
        Returns:
            The entry once its state is in `states` or terminal (the caller tells which);
            None if the deadline passes first.
        """
        wanted = frozenset(TransferState(s) for s in states) | TERMINAL_STATES
        while True:
            entry, last_event = self._snapshot(request_id)
            if entry is not None and entry.state in wanted:
                return entry
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            entry = self._wait_event(request_id, last_event, min(remaining, _BLOCK_SLICE_S))
            if entry is not None and entry.state in wanted:
                return entry  # a READY event carries the whole entry: no second read

    def _wait_event(self, request_id: str, after: bytes, timeout_s: float) -> DirectoryEntry | None:
        """Block until the request has an event newer than `after`, or timeout_s passes.

        A stream, not a list popped with BLPOP: reading leaves each event for every other
        waiter (a producer awaiting CONSUMED must not swallow the READY its consumer awaits),
        and an event added since the snapshot is newer than `after`, so none is missed.
        Returns:
            The entry, when the newest event is a READY one (it carries the location);
            otherwise None, and the caller reads the entry again.
        """
        events_key = self._entry_keys(request_id)[1]
        try:
            with self._errors("wait_for", request_id):
                reply = self._blocking.xread({events_key: after}, count=EVENTS_MAXLEN, block=_ms(timeout_s))
        except DirectoryError as exc:
            if not isinstance(exc.__cause__, redis.TimeoutError):
                raise
            # a Redis starved of CPU answers late: no event seen, the caller looks again until its deadline
            logger.warning("request %s: %s; waiting on", request_id, exc)
            return None
        got = cast(list[tuple[bytes, list[_StreamEntry]]], reply)  # RESP2: [[stream key, [(id, fields), ...]]]
        events = got[0][1] if got else []
        newest = events[-1][1] if events else {}
        return self._parse_entry(request_id, newest) if b"location" in newest else None

    def _snapshot(self, request_id: str) -> tuple[DirectoryEntry | None, bytes]:
        """The entry and the id of its latest event, read in one MULTI."""
        entry_key, events_key = self._entry_keys(request_id)
        with self._errors("wait_for", request_id):
            pipe = self._redis.pipeline(transaction=True)
            pipe.hgetall(entry_key)
            pipe.xrevrange(events_key, count=1)
            fields, last = pipe.execute()
        return self._parse_entry(request_id, fields), (last[0][0] if last else b"0-0")

    # --- many requests at once (a consumer's one watcher: connectors/consumer/watcher.py) ------------

    @_timed(DirectoryOp.LOOK)
    def look(self, request_ids: Iterable[str]) -> dict[str, Watched]:
        """Each request's entry and the id of its newest event (the cursor to wait after), read in one MULTI.
        Raises DirectoryError when Redis does not answer; an unreadable entry is that request's `error`."""
        rids = list(request_ids)
        with self._errors("look"):
            pipe = self._redis.pipeline(transaction=True)
            for rid in rids:
                entry_key, events_key = self._entry_keys(rid)
                pipe.hgetall(entry_key)
                pipe.xrevrange(events_key, count=1)
            replies = pipe.execute()
        seen: dict[str, Watched] = {}
        for i, rid in enumerate(rids):
            fields, last = cast(_Fields, replies[2 * i]), replies[2 * i + 1]
            cursor = last[0][0] if last else b"0-0"
            try:
                seen[rid] = Watched(self._parse_entry(rid, fields), cursor)
            except DirectoryError as exc:
                seen[rid] = Watched(None, cursor, exc.reason)
        return seen

    @_timed(DirectoryOp.WAIT_EVENTS)
    def wait_events(self, cursors: dict[str, bytes], wake: Wake, timeout_s: float) -> tuple[dict[str, Watched], Wake]:
        """Block in one XREAD until some request has an event after its cursor, `wake`'s stream has one after
        its cursor (`wake()` from another thread), or `timeout_s` passes.

        Returns:
            Per request with new events: its newest event's id, and the entry when that event is a READY one
            (it carries the location; otherwise the caller `look`s again); and `wake` moved past what was read.
        Raises:
            DirectoryError: Redis does not answer (a server that answers late counts as no event).
        """
        prefix = self._entry_keys("")[1]
        streams: dict[KeyT, StreamIdT] = {prefix + rid: cursor for rid, cursor in cursors.items()}
        streams[wake.key] = wake.cursor
        try:
            with self._errors("wait_events"):
                reply = self._blocking.xread(streams, count=EVENTS_MAXLEN, block=_ms(timeout_s))
        except DirectoryError as exc:
            if not isinstance(exc.__cause__, redis.TimeoutError):
                raise
            logger.warning("%s; waiting on", exc)
            return {}, wake
        seen: dict[str, Watched] = {}
        for key, events in cast(list[tuple[bytes, list[_StreamEntry]]], reply or []):
            newest_id, newest = events[-1]
            if key.decode() == wake.key:
                wake = Wake(wake.key, newest_id)
                continue
            rid = key.decode()[len(prefix):]
            try:
                entry = self._parse_entry(rid, newest) if b"location" in newest else None
                seen[rid] = Watched(entry, newest_id)
            except DirectoryError as exc:
                seen[rid] = Watched(None, newest_id, exc.reason)
        return seen, wake

    def wake_stream(self, owner: str) -> Wake:
        """A stream for `owner`'s `wait_events` to wake on, read from now on."""
        return Wake(f"{self.namespace}:wake:{owner}", b"0-0")

    def wake(self, wake: Wake) -> None:
        """End `wait_events` on `wake` now (or the next one, if none is blocked). Raises DirectoryError."""
        with self._errors("wake"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(wake.key, {b"w": b"1"}, maxlen=1, approximate=False)
            pipe.pexpire(wake.key, _ms(self.entry_ttl_s))
            pipe.execute()

    @_timed(DirectoryOp.DELETE)
    def delete(self, request_id: str) -> None:
        """Remove every key of the request."""
        with self._errors("delete", request_id):
            self._redis.delete(*self._entry_keys(request_id))

    def request_ids(self) -> list[str]:
        """Ids of the request entries still present, sorted (a SCAN; for tests and status)."""
        prefix = f"{self.namespace}:req:"
        with self._errors("request_ids"):
            keys = list(self._redis.scan_iter(match=prefix + "*", count=500))
        return sorted(k.decode()[len(prefix):] for k in keys)

    def entries_with_age(self) -> list[AgedEntry]:
        """Every request entry still present, sorted by request id, with its age (read-only; for status).

        Unreadable entries, and entries gone since they were listed, are skipped.
        """
        ids = self.request_ids()
        with self._errors("entries_with_age"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.time()
            for rid in ids:
                entry_key, events_key = self._entry_keys(rid)
                pipe.hgetall(entry_key)
                pipe.xrange(events_key, count=1)  # the first event's id is its creation time
            (sec, usec), *replies = pipe.execute()
        now_ms, aged = sec * 1000 + usec / 1000, []
        for rid, fields, first in zip(ids, replies[0::2], replies[1::2]):
            try:
                entry = self._parse_entry(rid, fields)
            except DirectoryError as exc:
                logger.warning("%s", exc)
                continue
            created_ms = int(first[0][0].split(b"-")[0]) if first else now_ms
            if entry is not None:
                aged.append(AgedEntry(entry, max(0.0, (now_ms - created_ms) / 1000)))
        return aged

    # --- node registry -----------------------------------------------------------------------

    def next_epoch(self, node_id: str) -> int:
        """A new epoch for this incarnation of `node_id`, higher than every earlier one."""
        epoch_key = self._node_keys(node_id)[1]
        with self._errors(f"next_epoch of node {node_id}"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.incr(epoch_key)
            pipe.pexpire(epoch_key, self._epoch_ttl_ms)
            epoch, _ = pipe.execute()
        return int(epoch)

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
        args: list[EncodableT] = [encode(info), info.epoch, _ms(self.node_ttl_s), self._epoch_ttl_ms]
        with self._errors(f"write node {info.node_id}"):
            ok, latest = self._put_node(keys=self._node_keys(info.node_id), args=args)
        if not ok:
            reason = f"node {info.node_id} epoch {info.epoch} is older than its latest epoch {latest}"
            raise StaleNodeError(reason, peer=self.peer)
        return int(latest)

    def deregister_node(self, node_id: str) -> None:
        """Remove the node's registration, or its claim where it never registered (its epoch counter stays)."""
        with self._errors(f"deregister node {node_id}"):
            self._redis.delete(self._node_keys(node_id)[0], self._claim_key(node_id))
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
        """Registered nodes, of `role` if given, sorted by node_id; unreadable records are skipped.

        Args:
            role: only nodes of this role; every role when None.
            include_draining: also list nodes that are shutting down (they take no new work).
            engine: only nodes behind which this engine serves (kvwire's own, by default: those take
                PrefillWork / DecodeWork); every engine when None.
        """
        with self._errors("live_nodes"):
            keys = list(self._redis.scan_iter(match=f"{self.namespace}:node:*", count=500))
            raws = cast(list[bytes | None], self._redis.mget(keys)) if keys else []
        nodes: list[NodeInfo] = []
        for key, raw in zip(keys, raws):
            try:
                info = _node_info(raw) if raw is not None else None  # None: expired since SCAN
            except WireError as exc:
                logger.warning("skipping unreadable node record %s: %s", key.decode(errors="replace"), exc)
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

    def close(self) -> None:
        """Close every pooled connection; the directory is not to be used afterwards."""
        self._pool.disconnect()
        self._blocking_pool.disconnect()

    # --- failing a request (every party that gives up on one goes through here) -------------

    def fail(self, request_id: str, reason: str, *, producer: str = "unknown",
             allowed_from: Iterable[TransferState] = (TransferState.PENDING, TransferState.READY)) -> bool:
        """Mark the request FAILED: its consumer recomputes the prompt now, its producer releases the KV.

        An absent entry is created PENDING first, so a consumer that has not looked yet finds it FAILED.
        Args:
            reason: why, stored with the entry (truncated to 500 characters).
            producer: the producer to record on an entry created here.
            allowed_from: the states it may be failed from.
        Returns:
            True if the entry is now FAILED because of this call.
        Raises:
            DirectoryError: the directory cannot be reached.
        """
        self.create_pending(request_id, producer)
        return self.transition(request_id, allowed_from, TransferState.FAILED, reason[:500])
