"""A pull abandoned while its NCCL / Gloo lane still sends keeps its blocks held until the lane stops.

The lane's group is a stand-in whose sends stall until the test lets them end (the real pairs' failures are
tests/connectors/transports/nccl/test_nccl.py's, between processes): what is tested is the engine's contract
with the transfer server (`abandon` returning True, then `Claims.settled` exactly once, after the lane's end).
"""

from __future__ import annotations

import threading
import time

from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.nccl import send_engine
from kvwire.connectors.transports.nccl.send_engine import NCCLSendEngine
from kvwire.connectors.transports.transport import SendJob
from kvwire.connectors.wire import PullRequest
from tests.connectors import peer
from tests.connectors.transports.engine_stubs import Held, RecordingClaims

WAIT_S = 5.0


class _StalledGroup:
    """Sends that end only once `release` is set."""

    def __init__(self) -> None:
        self.sending, self.release = threading.Event(), threading.Event()

    def post_sends(self, pieces, transfer_id):
        self.sending.set()
        return []

    def wait_all(self, works, deadline) -> None:
        self.release.wait(WAIT_S)

    def discard(self) -> None:
        pass


def _until(predicate, timeout_s: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


def _engine_with_job(monkeypatch, group: _StalledGroup) -> tuple[NCCLSendEngine, RecordingClaims, SendJob]:
    """An engine whose lanes send through `group`, and a pull of 2 blocks for it (not started)."""
    monkeypatch.setattr(send_engine._Lane, "_group_for", lambda lane, job: group)
    region = KVRegion.from_kv_caches(KVPool.allocate(peer.layout(), 4).kv_caches)
    engine = NCCLSendEngine("127.0.0.1", region, 5.0)
    engine.bind(claims := RecordingClaims())
    msg = PullRequest(request_id="stalled", transfer_id=1, consumer="c", transport_address=engine.transport_address,
                      dst_block_ids=[0, 1])
    return engine, claims, SendJob(b"", msg, Held(), region, [(0, 2)], time.monotonic())


def test_a_lane_still_sending_after_the_abandon_keeps_the_blocks_until_it_stops(monkeypatch):
    monkeypatch.setattr(send_engine, "ABANDON_WAIT_S", 0.05)
    group = _StalledGroup()
    engine, claims, job = _engine_with_job(monkeypatch, group)
    try:
        engine.start(job)
        assert group.sending.wait(WAIT_S), "the lane never sent"
        assert engine.abandon(job), "the engine let go of the blocks of a pull its lane still sends"
        assert claims.settled_jobs == []
        group.release.set()
        assert _until(lambda: claims.settled_jobs == [job]), claims.events
        assert claims.events == [("finish", job), ("settled", job)]
    finally:
        group.release.set()
        engine.close()


def test_a_lane_that_stopped_in_time_hands_the_blocks_back_at_the_abandon(monkeypatch):
    group = _StalledGroup()
    group.release.set()
    engine, claims, job = _engine_with_job(monkeypatch, group)
    try:
        engine.start(job)
        assert _until(lambda: claims.events == [("finish", job)])
        assert not engine.abandon(job)
        time.sleep(0.05)  # a wrong `settled` would come from the lane's thread: give it the time to
        assert claims.events == [("finish", job)]
    finally:
        engine.close()
