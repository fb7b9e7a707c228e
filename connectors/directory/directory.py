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

The node registry over the same connection: nodes.py; the connection: connection.py.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, cast

import redis
from redis.typing import EncodableT, KeyT, StreamIdT

from kvwire.connectors.directory.connection import (
    _BLOCK_SLICE_S,
    DirectoryError,
    StaleNodeError,
    _Fields,
    _ms,
    _StreamEntry,
    _timed,
)
from kvwire.connectors.directory.nodes import NodeRegistry
from kvwire.connectors.directory.scripts import EVENTS_MAXLEN
from kvwire.connectors.wire import KVLocation, WireError, decode, encode
from kvwire.observability.labels import DirectoryOp

logger = logging.getLogger(__name__)


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


def _location(raw: bytes) -> KVLocation:
    location = decode(raw, expect=KVLocation)
    assert isinstance(location, KVLocation)  # decode rejects every other type
    return location


class KVDirectory(NodeRegistry):
    """Client of the directory: request entries here, the node registry (nodes.py) over the same connection
    (connection.py: `DirectoryConnection`, whose arguments it takes); thread-safe, one per process is enough.

    Every method raises DirectoryError when Redis cannot be reached.
    """

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
