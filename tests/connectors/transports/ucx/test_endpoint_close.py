"""Closing the endpoints to a peer (`UCXWorker.forget_peer`) after a pull to it failed or was abandoned.

Real UCX between real processes. Two hazards, both in ucxx's non-blocking `close()` that kvwire used before
`close_endpoint`: on an endpoint UCX's error callback had closed already (its peer died) it returned a request
wrapper around a null pointer, and the producer died of SIGSEGV as that was freed; and on an endpoint to a peer
that lives but never progresses, the send posted on it stayed in flight for good, its buffer pinned. The producer
runs in a child, so that a crash shows as its exit code. And the send engine keeps an abandoned pull's flow, the
buffers its sends read and its blocks with it, until every one of them has ended (`UCXSendEngine.settling`); over
TCP it parks the pull's endpoints rather than force-closing them with a send stuck in one (worker.py `park`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.transport import SendJob
from kvwire.connectors.transports.ucx import libucp
from kvwire.connectors.transports.ucx import worker as worker_module
from kvwire.connectors.transports.ucx.flows import SendFlow
from kvwire.connectors.transports.ucx.packing import Staging
from kvwire.connectors.transports.ucx.send_engine import DRAIN_S, SETTLE_S, UCXSendEngine
from kvwire.connectors.transports.ucx.worker import Role, UCXWorker
from kvwire.connectors.wire import DType, PullRequest
from tests import procs
from tests.connectors import peer
from tests.connectors.transports.engine_stubs import Held, RecordingClaims

CTX = procs.CTX
MESSAGE = 1 << 20  # one rendezvous message: the consumer must answer before it moves
CONNECT_S = 0.5  # the producer progresses its endpoints this long before the consumer goes
DEADLINE_S = 20.0  # for a send to a dead or silent peer to end, and for each child's answer


def consume(addresses, progressing: bool) -> None:
    """Child: a consumer's worker that says its address, then progresses forever (or never)."""
    worker = UCXWorker(Role.CONSUMER)
    addresses.put(worker.address)
    while True:
        if progressing:
            worker.progress()
        time.sleep(0.001)


def _progress_for(worker: UCXWorker, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        worker.progress()
        time.sleep(0.001)


def _send_until_done(worker: UCXWorker, flow: SendFlow, deadline_s: float) -> str:
    """Progress `flow` until it is done; returns its error ("" for none, "timeout" if it never ended)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        worker.progress()
        flow.advance()
        if flow.done():
            try:
                flow.check_errors()
            except Exception as exc:  # noqa: BLE001 - the UCX error is what the test reports
                return type(exc).__name__ or "error"
            return ""
    return "timeout"


def produce_to_dead_peer(address: bytes, ready, killed, results) -> None:
    """Child: endpoints to a consumer that then dies; a send to it fails; its endpoints are closed."""
    worker = UCXWorker(Role.PRODUCER)
    worker.link(address, True)
    _progress_for(worker, CONNECT_S)
    ready.set()
    killed.wait(DEADLINE_S)
    flow = SendFlow(worker, address, [memoryview(bytearray(MESSAGE))], 1, 0, Staging(1), guarded=True)
    error = _send_until_done(worker, flow, DEADLINE_S)
    worker.forget_peer(address)
    gc.collect()
    worker.progress()
    del flow
    gc.collect()
    worker.close()
    results.put(error)


def produce_to_silent_peer(address: bytes, results) -> None:
    """Child: a send to a consumer that never progresses, abandoned: its request ends once the endpoint closes."""
    worker = UCXWorker(Role.PRODUCER)
    flow = SendFlow(worker, address, [memoryview(bytearray(MESSAGE))], 1, 0, Staging(1), guarded=True)
    _progress_for(worker, CONNECT_S)
    in_flight = not flow.done()
    worker.forget_peer(address)
    end = time.monotonic() + DEADLINE_S
    while not flow.settled() and time.monotonic() < end:
        worker.progress()
    results.put((in_flight, flow.settled()))
    worker.close()


def _consumer(progressing: bool):
    addresses = CTX.Queue()
    consumer = CTX.Process(target=consume, args=(addresses, progressing), daemon=True)
    consumer.start()
    return consumer, addresses.get(timeout=DEADLINE_S)


def _produce_while_the_consumer_dies(target):
    """Run `target(address, ready, killed, results)` in a producer child; kill the consumer once it is ready.
    Returns what the child put in `results`, after checking that it exited cleanly (a crash is its exit code)."""
    consumer, address = _consumer(progressing=True)
    ready, killed, results = CTX.Event(), CTX.Event(), CTX.Queue()
    producer = CTX.Process(target=target, args=(address, ready, killed, results))
    producer.start()
    try:
        assert ready.wait(DEADLINE_S)
        consumer.kill()
        consumer.join(DEADLINE_S)
        killed.set()
        producer.join(3 * DEADLINE_S)
        assert producer.exitcode == 0, f"the producer died (exit code {producer.exitcode})"
        return results.get(timeout=1)
    finally:
        for proc in (producer, consumer):
            proc.kill()
            proc.join(DEADLINE_S)


def test_a_dead_peers_endpoints_close_without_crashing_the_producer():
    error = _produce_while_the_consumer_dies(produce_to_dead_peer)
    assert error not in ("", "timeout"), "a send to a dead peer neither failed nor ended"


def test_a_send_to_a_peer_that_never_answers_ends_when_its_endpoint_closes():
    consumer, address = _consumer(progressing=False)
    results = CTX.Queue()
    producer = CTX.Process(target=produce_to_silent_peer, args=(address, results))
    producer.start()
    try:
        in_flight, settled = results.get(timeout=2 * DEADLINE_S)
        assert in_flight, "the send completed although its peer never progressed"
        assert settled, f"the send was still in flight {DEADLINE_S} s after its endpoint closed"
        producer.join(DEADLINE_S)
        assert producer.exitcode == 0
    finally:
        for proc in (producer, consumer):
            proc.kill()
            proc.join(DEADLINE_S)


def _engine_with_pull(address: bytes, request_id: str,
                      drain_s: float = DRAIN_S) -> tuple[UCXSendEngine, RecordingClaims, SendJob]:
    """A send engine and a guarded pull of 8 blocks of 128 KiB (rendezvous messages) to the consumer at `address`."""
    pool = KVPool.allocate(peer.layout(DType.FLOAT32, 4, 256), 8)
    msg = PullRequest(request_id=request_id, transfer_id=1, consumer=request_id, transport_address=address,
                      dst_block_ids=list(range(8)), guarded=True)
    job = SendJob(b"", msg, Held(), KVRegion.from_kv_caches(pool.kv_caches), [(0, 8)], time.monotonic())
    engine = UCXSendEngine(drain_s=drain_s)
    engine.bind(claims := RecordingClaims())
    return engine, claims, job


def _started_and_stuck(engine: UCXSendEngine, claims: RecordingClaims, job: SendJob) -> None:
    engine.start(job)
    end = time.monotonic() + CONNECT_S
    while time.monotonic() < end:
        engine.progress()
    assert not claims.finished, "a send to a consumer that never progressed ended"


def _progress_until_settled(engine: UCXSendEngine, timeout_s: float) -> float:
    """Seconds until nothing settles any more (at least `timeout_s` if something still does)."""
    start = time.monotonic()
    while engine.settling and time.monotonic() < start + timeout_s:
        engine.progress()
        time.sleep(0.001)
    return time.monotonic() - start


def test_an_abandoned_pulls_flow_and_blocks_are_kept_until_its_sends_end():
    consumer, address = _consumer(progressing=False)
    engine, claims, job = _engine_with_pull(address, "abandoned")
    try:
        _started_and_stuck(engine, claims, job)
        assert engine.abandon(job), "the engine let go of the blocks of a pull whose sends were in flight"
        assert engine.settling == 1
        _progress_until_settled(engine, DEADLINE_S)
        assert engine.settling == 0, f"the abandoned pull's sends were in flight {DEADLINE_S} s after it"
        assert claims.settled_jobs == [job]  # its blocks go now
        assert not claims.finished  # abandoned: the transfer server, not the engine, answers the consumer
    finally:
        engine.close()
        consumer.kill()
        consumer.join(DEADLINE_S)


def _spy_forced_closes(monkeypatch) -> list[int]:
    statuses: list[int] = []

    def spy(handle, progress, **kwargs):
        statuses.append(libucp.force_close(handle, progress, **kwargs))
        return statuses[-1]

    monkeypatch.setattr(worker_module, "force_close", spy)
    return statuses


def _spy_closes(monkeypatch) -> list[str]:
    """Every endpoint the worker closes from now on: "failed" (its peer had failed) or "healthy"."""
    closes: list[str] = []
    real = worker_module.close_endpoint

    def spy(ep, guarded, progress):
        closes.append("healthy" if ep.alive else "failed")
        real(ep, guarded, progress)

    monkeypatch.setattr(worker_module, "close_endpoint", spy)
    return closes


def test_over_tcp_an_abandoned_pulls_endpoints_stay_open_until_the_consumer_goes(monkeypatch):
    """Over TCP a stuck send is never force-closed (worker.py `park`): the endpoints stay open, the blocks held,
    until the consumer's socket closes; then the failed endpoint is closed and the blocks go, long before DRAIN_S."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # both ends: the consumer child inherits it
    closing = _spy_closes(monkeypatch)
    consumer, address = _consumer(progressing=False)
    engine, claims, job = _engine_with_pull(address, "parked")
    try:
        _started_and_stuck(engine, claims, job)
        assert engine._transport.path_to(address).transports == ("tcp",)  # test-only reach: what UCX chose
        assert engine.abandon(job)
        assert _progress_until_settled(engine, 2 * CONNECT_S) >= 2 * CONNECT_S, "an abandoned send ended unread"
        assert closing == [] and claims.settled_jobs == [], "a pull's endpoints closed while its send was stuck"
        consumer.kill()
        consumer.join(DEADLINE_S)
        took = _progress_until_settled(engine, DEADLINE_S)
        assert engine.settling == 0 and claims.settled_jobs == [job], f"settling {took:.1f} s after the consumer died"
        assert took < DRAIN_S / 2, took
        assert closing and set(closing) == {"failed"}, closing  # closed once it failed, never while stuck
    finally:
        engine.close()
        consumer.kill()
        consumer.join(DEADLINE_S)


def test_over_tcp_a_parked_link_to_a_consumer_that_never_reads_closes_when_its_drain_is_up(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    consumer, address = _consumer(progressing=False)
    drain_s = 1.0
    engine, claims, job = _engine_with_pull(address, "drained", drain_s)
    try:
        _started_and_stuck(engine, claims, job)
        assert engine.abandon(job)
        took = _progress_until_settled(engine, DEADLINE_S)
        assert engine.settling == 0 and claims.settled_jobs == [job], f"still settling after {took:.1f} s"
        assert drain_s <= took < drain_s + SETTLE_S + 1.0, took
    finally:
        engine.close()
        consumer.kill()
        consumer.join(DEADLINE_S)


def test_a_pull_that_failed_on_a_dead_consumer_closes_its_failed_endpoint_at_once(monkeypatch):
    """ucxx leaves a guarded endpoint whose peer failed open (libucp.py): the engine force-closes it as the pull
    fails, and UCX completes that close; a healthy endpoint is closed by ucxx, with no forced close."""
    statuses = _spy_forced_closes(monkeypatch)
    consumer, address = _consumer(progressing=True)
    engine, claims, job = _engine_with_pull(address, "dead")
    try:
        engine._transport.link(address)  # test-only reach: connected while the consumer lives
        _progress_for(engine._transport, CONNECT_S)
        consumer.kill()
        consumer.join(DEADLINE_S)
        engine.start(job)
        end = time.monotonic() + DEADLINE_S
        while not claims.finished and time.monotonic() < end:
            engine.progress()
        assert claims.finished and claims.finished[0][1] is not None, "a pull to a dead consumer did not fail"
        assert statuses == [0], f"the failed endpoint was not closed (forced closes: {statuses})"
        healthy, healthy_address = _consumer(progressing=True)
        try:
            engine._transport.link(healthy_address)  # test-only reach: the engine's worker
            engine._transport.forget_peer(healthy_address)
            assert statuses == [0]  # ucxx closed that one itself
        finally:
            healthy.kill()
            healthy.join(DEADLINE_S)
    finally:
        engine.close()
        consumer.kill()
        consumer.join(DEADLINE_S)


@dataclass
class _ClosedGate:
    """A layer-wise prefill that has written no layer until `open` is set."""

    request_id: str = "waiting"
    open: bool = False

    def ready_layers(self) -> int:
        return 0

    @property
    def complete_and_ready(self) -> bool:
        return self.open

    @property
    def failure(self) -> None:
        return None

    def needs_polling(self) -> bool:
        return False


def two_pulls_to_a_dead_consumer(address: bytes, ready, killed, results) -> None:
    """Child: two pulls to one consumer, the second waiting for its prefill's first layer. The consumer dies, the
    first pull fails and the engine closes the endpoints to it; then the second's layer comes."""
    engine, claims, first = _engine_with_pull(address, "first")
    gate = _ClosedGate()
    second = SendJob(b"", first.msg, Held(gate=gate), first.region, first.runs, first.deadline)
    engine.start(second)  # nothing to send yet; its endpoints are made now, and connect while the consumer lives
    _progress_for(engine._transport, CONNECT_S)  # test-only reach: the engine's worker
    ready.set()
    killed.wait(DEADLINE_S)
    engine.start(first)
    end = time.monotonic() + DEADLINE_S
    while not claims.finished and time.monotonic() < end:
        engine.progress()
    gate.open = True
    end = time.monotonic() + DEADLINE_S
    while len(claims.finished) < 2 and time.monotonic() < end:
        engine.progress()
    results.put([(job.msg.request_id if job is first else "second", type(exc).__name__ if exc else "")
                 for job, exc in claims.finished])
    engine.close()


def test_a_pull_whose_endpoints_another_failed_pull_closed_fails_without_touching_them():
    """The second pull still held the endpoints the first pull's failure had force-closed: posting through them was
    a use after free in UCX (SIGSEGV: ucxx keeps a force-closed endpoint's freed handle). It fails, typed."""
    finished = dict(_produce_while_the_consumer_dies(two_pulls_to_a_dead_consumer))
    assert finished["first"] != "", "a pull to a dead consumer did not fail"
    assert finished.get("second") == "EndpointClosed", finished


def test_a_new_pull_first_closes_the_links_whose_peer_failed():
    """A consumer's worker that failed after its last pull here (fenced, or dead) leaves its link failed; the next
    pull closes it, and leaves healthy links alone."""
    dead, dead_address = _consumer(progressing=True)
    healthy, healthy_address = _consumer(progressing=True)
    engine, _, job = _engine_with_pull(healthy_address, "after")
    worker = engine._transport  # test-only reach: the engine's worker
    try:
        failed_link = worker.link(dead_address)
        _progress_for(worker, CONNECT_S)
        dead.kill()
        dead.join(DEADLINE_S)
        flow = SendFlow(worker, dead_address, [memoryview(bytearray(MESSAGE))], 1, 0, Staging(1), guarded=True)
        assert _send_until_done(worker, flow, DEADLINE_S) not in ("", "timeout")
        assert not failed_link.closed  # nothing closed it: the pull that failed was not the engine's
        engine.start(job)
        assert failed_link.closed
        assert not worker.link(healthy_address).closed
    finally:
        engine.close()
        for proc in (dead, healthy):
            proc.kill()
            proc.join(DEADLINE_S)


def test_ucx_keepalive_is_off_unless_the_environment_turns_it_on(monkeypatch):
    """UCX 1.21's keepalive round crashed a consumer after failed pulls (worker.py's `_KEEPALIVE`)."""
    worker = UCXWorker(Role.CONSUMER)
    try:
        assert worker._ctx.config["KEEPALIVE_INTERVAL"] == "inf"  # test-only reach: UCX's own reading of it
    finally:
        worker.close()
    monkeypatch.setenv("UCX_KEEPALIVE_INTERVAL", "5s")
    worker = UCXWorker(Role.CONSUMER)
    try:
        assert worker._ctx.config["KEEPALIVE_INTERVAL"] != "inf"
    finally:
        worker.close()
