"""The consumer's one directory watcher, on a real redis-server: every expected request in one thread."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.connectors.consumer.watcher import WATCH_SLICE_S, Watcher
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.observability.labels import TransferFailure
from tests.connectors.directory.test_directory import location


@pytest.fixture
def watched(directory: KVDirectory):
    """A watcher, and the queue its settled request ids arrive on (with when)."""
    got: queue.Queue[tuple[str, float]] = queue.Queue()
    watcher = Watcher(directory, lambda rid: got.put((rid, time.monotonic())), "test-consumer")
    yield watcher, got
    watcher.close()


def _record(rid: str, deadline_s: float = 30.0) -> ExpectedKV:
    return ExpectedKV(rid, "prefill-0", time.monotonic() + deadline_s, watched=True)


def _settled(got: queue.Queue, n: int, timeout_s: float = 10.0) -> dict[str, float]:
    out: dict[str, float] = {}
    end = time.monotonic() + timeout_s
    while len(out) < n:
        rid, when = got.get(timeout=max(0.0, end - time.monotonic()))
        assert rid not in out, f"{rid} handed on twice"
        out[rid] = when
    return out


def test_hundreds_of_requests_settle_from_one_thread(directory, watched):
    """300 awaited requests (the thread pool it replaced held 128) are all settled by READY events, and one
    kv-watch thread does it."""
    watcher, got = watched
    records = [_record(f"many-{i}") for i in range(300)]
    for r in records:
        directory.create_pending(r.request_id, "prefill-0")
        watcher.add(r)
    time.sleep(0.1)
    for r in records:
        assert directory.publish_ready(location(r.request_id))
    assert set(_settled(got, 300)) == {r.request_id for r in records}
    assert all(r.location == location(r.request_id) for r in records)
    assert [t.name for t in threading.enumerate()].count("kv-watch") == 1


def test_a_request_added_while_the_watcher_waits_is_read_at_once(directory, watched):
    """The watcher blocks on one request's stream; a second one, already FAILED, added with no head start ends
    that wait and is settled long before the wait would have ended."""
    watcher, got = watched
    directory.create_pending("slow", "prefill-0")
    watcher.add(_record("slow"))
    time.sleep(0.1)  # the watcher is in its XREAD now
    directory.fail("failed", "the prefill node refused it", producer="prefill-0")
    start, record = time.monotonic(), _record("failed")
    watcher.add(record)
    when = _settled(got, 1)
    assert when["failed"] - start < WATCH_SLICE_S / 2
    assert record.failure_kind == TransferFailure.PRODUCER and "refused" in record.failure


def test_a_failure_after_the_watch_began_is_seen_and_a_deadline_gives_up(directory, watched):
    """A PENDING entry that turns FAILED while watched (an event that is not READY: the entry is read again)
    settles as the producer's failure; a request with no entry at all is given up at its deadline."""
    watcher, got = watched
    directory.create_pending("turns-failed", "prefill-0")
    failed, late = _record("turns-failed"), _record("never", deadline_s=0.4)
    start = time.monotonic()
    watcher.add(failed)
    watcher.add(late)
    time.sleep(0.1)
    directory.fail("turns-failed", "out of blocks", producer="prefill-0")
    when = _settled(got, 2)
    assert failed.failure_kind == TransferFailure.PRODUCER and "out of blocks" in failed.failure
    assert when["turns-failed"] < when["never"]
    assert late.failure_kind == TransferFailure.DEADLINE and 0.4 <= when["never"] - start < 0.4 + WATCH_SLICE_S


def test_a_record_settled_elsewhere_is_dropped_and_not_handed_on(directory, watched):
    """The producer's KVReady settles a record first: the watcher hands on nothing for it."""
    watcher, got = watched
    record = _record("told")
    directory.create_pending("told", "prefill-0")
    watcher.add(record, head_start_s=0.05)
    assert record.locate(location("told"))
    directory.publish_ready(location("told"))
    with pytest.raises(queue.Empty):
        got.get(timeout=2 * WATCH_SLICE_S)
