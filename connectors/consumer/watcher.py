"""A consumer's one directory watcher: a thread that waits on the directory for every expected request at once.

1. `KVConsumer.expect` hands it a record (`add`), with a head start: until that passes the
   directory is not read for it (the producer's KVReady usually settles it first).
2. Each turn, the records whose head start has passed and that have no cursor yet are read in one
   round trip (`KVDirectory.look`: the entry, and the id of its newest event); then one XREAD
   (`KVDirectory.wait_events`) blocks on all their event streams and on this watcher's wake
   stream, for at most WATCH_SLICE_S, and less when a head start or a deadline ends sooner.
   With no record to read, the thread waits on an in-process event instead: no Redis traffic.
3. A READY entry or event settles its record with the location, a terminal entry settles it as
   failed (PRODUCER), and a record whose deadline passes is given up (DEADLINE, or DIRECTORY when
   Redis did not answer the last time it was asked). Records settled elsewhere (the KVReady,
   the producer watch) are dropped at the next turn. Every settling made here is handed to
   `settled(request_id)` (the consumer's mailbox, which wakes its node).
4. A record added with no head start while the XREAD blocks ends that wait (`KVDirectory.wake`:
   one XADD from the adding thread), so it is read at once; one with a head start is read by the
   end of the current wait, at most WATCH_SLICE_S after its head start.
5. Redis not answering: every record is read afresh WATCH_RETRY_S later, until its deadline.
6. `close()` stops the thread (within one wait).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.connectors.directory.directory import (
    DirectoryEntry,
    DirectoryError,
    KVDirectory,
    TransferState,
    Watched,
)
from kvwire.observability.labels import TransferFailure

log = logging.getLogger(__name__)

WATCH_SLICE_S = 0.25  # longest single wait: a record settled elsewhere is dropped within this
WATCH_RETRY_S = 0.5  # a directory that did not answer is asked again after this


def settle_from(record: ExpectedKV, entry: DirectoryEntry | None) -> bool:
    """Settle `record` from its entry (None: the deadline passed with none READY); returns whether this did."""
    if entry is None:
        return record.give_up("KV not ready before the deadline", TransferFailure.DEADLINE)
    if entry.state == TransferState.READY and entry.location is not None:
        return record.locate(entry.location)
    return record.give_up(f"entry is {entry.state}: {entry.reason}", TransferFailure.PRODUCER)


@dataclass(eq=False)
class _Watch:
    record: ExpectedKV
    start: float  # time.monotonic() from which the directory is read for it
    cursor: bytes | None = None  # its newest event's id once read; None: read it (again) next turn
    unanswered: str = ""  # why the directory's last answer for it failed; "" once it answers


class Watcher:
    def __init__(self, directory: KVDirectory, settled: Callable[[str], None], owner: str):
        """`owner` names the wake stream: unique per consumer (process and node)."""
        self._directory = directory
        self._settled = settled
        self._wake = directory.wake_stream(owner)
        self._lock = threading.Lock()
        self._added: list[_Watch] = []  # guarded by _lock; taken by the thread each turn
        self._redis_until = 0.0  # guarded by _lock: when the XREAD in progress ends (0: none in progress)
        self._kick = threading.Event()  # something was added (or close): an idle wait ends
        self._stop = threading.Event()
        self._watches: dict[str, _Watch] = {}  # the thread's own
        self._thread = threading.Thread(target=self._run, name="kv-watch", daemon=True)
        self._thread.start()

    def add(self, record: ExpectedKV, head_start_s: float = 0.0) -> None:
        """Watch `record` until it is settled (by anyone) or its deadline; read the directory from `head_start_s`
        on. Any thread."""
        now = time.monotonic()
        with self._lock:
            self._added.append(_Watch(record, now + head_start_s))
            wake = head_start_s <= 0 and self._redis_until > now
        self._kick.set()
        if wake:
            try:
                self._directory.wake(self._wake)
            except DirectoryError as exc:  # the current wait ends within WATCH_SLICE_S anyway
                log.info("request %s: could not wake the directory watcher: %s", record.request_id, exc)

    def close(self) -> None:
        self._stop.set()
        self._kick.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # noqa: BLE001 - the thread must live: its records must still settle
                log.warning("the directory watcher's turn failed: %s", exc)
                self._stop.wait(WATCH_RETRY_S)

    def _turn(self) -> None:
        now = self._take_added()
        self._give_up_late(now)
        due = [w for w in self._watches.values() if w.cursor is None and w.start <= now]
        try:
            if due:
                self._take_looks(due, self._directory.look(w.record.request_id for w in due))
            waiting = {rid: w.cursor for rid, w in self._watches.items() if w.cursor is not None}
            timeout_s = self._timeout(time.monotonic())
            if not waiting:
                self._kick.wait(timeout_s)
                return
            with self._lock:
                if self._added:  # added since this turn began, unwoken: take them first
                    return
                self._redis_until = time.monotonic() + timeout_s
            try:
                seen, self._wake = self._directory.wait_events(waiting, self._wake, timeout_s)
            finally:
                with self._lock:
                    self._redis_until = 0.0
            self._take_events(seen)
        except DirectoryError as exc:
            log.info("the directory did not answer (%s); asking again within each request's deadline", exc)
            for w in self._watches.values():
                w.cursor, w.unanswered = None, f"watching the directory failed: {exc}"
            self._stop.wait(WATCH_RETRY_S)

    def _take_added(self) -> float:
        """Move the added records in and drop the settled ones; returns the time now."""
        with self._lock:
            added, self._added = self._added, []
            self._kick.clear()
        for w in added:
            self._watches[w.record.request_id] = w
        for rid in [rid for rid, w in self._watches.items() if w.record.settled]:
            del self._watches[rid]
        return time.monotonic()

    def _give_up_late(self, now: float) -> None:
        for rid, w in list(self._watches.items()):
            if now >= w.record.deadline:
                del self._watches[rid]
                if w.unanswered:
                    settled = w.record.give_up(w.unanswered, TransferFailure.DIRECTORY)
                else:
                    settled = settle_from(w.record, None)
                if settled:
                    self._settled(rid)

    def _take_looks(self, due: list[_Watch], seen: dict[str, Watched]) -> None:
        """What `look` said of each record due: settled when READY or terminal, else waited on after its cursor."""
        for w in due:
            got = seen[w.record.request_id]
            w.cursor, w.unanswered = got.cursor, ""
            if got.error or (got.entry is not None and got.entry.state != TransferState.PENDING):
                self._done(w, got)

    def _take_events(self, seen: dict[str, Watched]) -> None:
        """What `wait_events` said: a READY event settles its record; any other event has its entry read again."""
        for rid, got in seen.items():
            w = self._watches.get(rid)
            if w is None:
                continue
            w.cursor, w.unanswered = got.cursor, ""
            if got.error or got.entry is not None:
                self._done(w, got)
            else:
                w.cursor = None  # a new state that is not READY: read the entry next turn

    def _done(self, w: _Watch, got: Watched) -> None:
        rid = w.record.request_id
        del self._watches[rid]
        if got.error:
            settled = w.record.give_up(f"watching the directory failed: {got.error}", TransferFailure.DIRECTORY)
        else:
            settled = settle_from(w.record, got.entry)
        if settled:
            self._settled(rid)

    def _timeout(self, now: float) -> float:
        """How long this turn may wait: WATCH_SLICE_S, or less when a head start or a deadline ends sooner."""
        ends = [w.start for w in self._watches.values() if w.cursor is None and w.start > now]
        ends += [w.record.deadline for w in self._watches.values()]
        return max(0.001, min([WATCH_SLICE_S, *(e - now for e in ends)]))
