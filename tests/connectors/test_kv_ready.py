"""KVReady, the producer's KVReady to the consumer: ordering against the directory, and who may use it."""

from __future__ import annotations

import select
import time

import msgspec
import torch
import zmq

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import DIRECT_HEAD_START_S
from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.producer.role import ADVERTISE_DELAY_S
from kvwire.connectors.standalone import open_consumer, open_producer
from kvwire.connectors.wire import KVLocation, KVReady, PullRequest
from kvwire.observability.metrics import process_metrics
from kvwire.protocol.work import CancelWork
from tests import procs
from tests.connectors import peer

CTX = procs.CTX


def _config(role: NodeRole, node_id: str, redis_url: str, deadline_s: float = 10.0) -> ConnectorConfig:
    return ConnectorConfig(kind=ConnectorKind.TCP, role=role, node_id=node_id, redis_url=redis_url,
                           kv_deadline_s=deadline_s)


def _work_socket() -> tuple[zmq.Socket, str]:
    """A PULL socket standing in for a consumer's inbox, and its address."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _consumer(node_id: str, redis_url: str):
    """A TCP consumer with an 8-block pool and a 5 s KV deadline."""
    return open_consumer(_config(NodeRole.DECODE, node_id, redis_url, deadline_s=5.0), layout=peer.layout(),
                         num_blocks=8)


def _ready_as_told(consumer, want: int, timeout_s: float) -> list[tuple[str, float]]:
    """What the consumer queues for its owner, with when its wake-up fd said so, as a node loop reads it."""
    told: list[tuple[str, float]] = []
    deadline = time.monotonic() + timeout_s
    while len(told) < want and (left := deadline - time.monotonic()) > 0:
        select.select([consumer.wakeup.fd], [], [], left)
        now = time.monotonic()
        consumer.wakeup.drain()
        told += [(rid, now) for rid in consumer.ready()]
    return told


def _location(rid: str) -> KVLocation:
    """A TCP location from producer "p", as its KVReady carries it."""
    return KVLocation(request_id=rid, producer="p", producer_epoch=1, kind=ConnectorKind.TCP,
                      side_channel="tcp://127.0.0.1:1", transport_address=b"127.0.0.1:2", layout=peer.layout(),
                      block_ids=[0], num_tokens=3, hidden=[])


def _kv_ready(sock: zmq.Socket) -> KVReady:
    assert sock.poll(5000), "no KVReady"
    return unpack(sock.recv(), expect=KVReady)


def test_a_pull_delivered_before_the_ready_lands_is_recorded_after_it(redis_url, monkeypatch):
    """A consumer told directly can finish its pull before the producer's READY reaches the directory; the
    CONSUMED + delete must then follow the READY, or the entry would be left READY for good."""
    sock, endpoint = _work_socket()
    side = open_producer(_config(NodeRole.PREFILL, "p-ready", redis_url), layout=peer.layout(), num_blocks=8)
    server = side.producer._servers[ConnectorKind.TCP]  # test-only reach: the transfer server's delivery hook
    publish_ready = side.directory.publish_ready
    seen: list[KVLocation] = []

    def pulled_before_the_ready(loc: KVLocation) -> bool:  # the whole pull, between the KVReady and READY
        seen.append(_kv_ready(sock).location)
        server._on_delivered(PullRequest(request_id=loc.request_id, transfer_id=1, consumer="d",
                                         transport_address=b"", dst_block_ids=[0, 1]), 100)
        return publish_ready(loc)

    monkeypatch.setattr(side.directory, "publish_ready", pulled_before_the_ready)
    try:
        seq = SequenceInput("early-1", [0] * 5, 0, [2, 3], consumer_endpoint=endpoint)
        side.producer.publish(ModelInput([seq]), torch.zeros(5, peer.HIDDEN))
        _wait_until(lambda: seen)  # the READY goes ADVERTISE_DELAY_S after the KVReady
        assert [loc.request_id for loc in seen] == ["early-1"] and seen[0].block_ids == [2, 3]
        _wait_until(lambda: side.directory.get("early-1") is None)  # CONSUMED and deleted, not left READY
    finally:
        side.close()
        sock.close(0)


def test_the_ready_of_a_request_told_directly_comes_after_the_kv_ready_location(redis_url):
    """Told directly, the consumer pulls first; the directory's READY (its fallback) follows a few ms later,
    off the way to the first token. A request nobody was told of is advertised at once."""
    sock, endpoint = _work_socket()
    side = open_producer(_config(NodeRole.PREFILL, "p-later", redis_url), layout=peer.layout(), num_blocks=8)
    try:
        side.producer.publish(ModelInput([SequenceInput("told", [0] * 5, 0, [2, 3], consumer_endpoint=endpoint)]),
                              torch.zeros(5, peer.HIDDEN))
        published_at = time.monotonic()
        assert _kv_ready(sock).location.request_id == "told"
        entry = side.directory.get("told")
        assert entry is None or entry.state != TransferState.READY or \
            time.monotonic() - published_at >= ADVERTISE_DELAY_S, "READY before its delay"
        _wait_until(lambda: (e := side.directory.get("told")) is not None and e.state == TransferState.READY)
        side.producer.publish(ModelInput([SequenceInput("untold", [0] * 5, 0, [4, 5])]), torch.zeros(5, peer.HIDDEN))
        assert side.directory.get("untold").state == TransferState.READY, "nobody told: advertised at once"
    finally:
        side.close()
        sock.close(0)


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_the_consumer_takes_a_direct_location_only_for_a_request_it_expects(redis_url):
    side = _consumer("d-ready", redis_url)
    consumer = side.consumer
    loc = _location("direct-1")
    try:
        record = consumer.expect("direct-1", producer="p")
        assert not consumer.take_kv_ready(msgspec.structs.replace(loc, producer="p-other")), "not its producer"
        assert record.location is None and not record.settled and consumer.ready() == []
        assert consumer.take_kv_ready(loc)
        assert record.settled and record.location == loc  # the pull starts from it: no directory read
        assert select.select([consumer.wakeup.fd], [], [], 0)[0], "the owner's loop is woken"
        assert consumer.ready() == ["direct-1"]
        assert not consumer.take_kv_ready(loc), "located once"
    finally:
        side.close()


def test_a_kv_ready_that_beats_its_work_is_kept_for_it(redis_url):
    """The producer's KVReady can reach the decode node before the router's work does: it is kept, and the work's
    `expect` takes it at once (from the producer the work names only)."""
    side = _consumer("d-early", redis_url)
    consumer = side.consumer
    loc = _location("early-1")
    try:
        assert not consumer.take_kv_ready(loc), "not expected yet: kept, not taken"
        assert not consumer.take_kv_ready(msgspec.structs.replace(loc, request_id="early-2"))
        record = consumer.expect("early-1", producer="p", head_start_s=1.0)
        assert record.settled and record.location == loc and consumer.ready() == ["early-1"]
        other = consumer.expect("early-2", producer="p-other", head_start_s=1.0)
        assert not other.settled and other.location is None, "a KVReady from another producer than the work's"
    finally:
        side.close()


def test_producer_tells_the_consumer_in_its_inbox_and_the_consumer_pulls(redis_url):
    """Two standalone roles over TCP, in two processes, around the session's redis: no node, engine or router.
    The producer pushes its KVReady to the consumer's own inbox; the consumer's `ready()` reads it."""
    lay, rid, tokens = peer.layout(), "direct-pull", 10
    src, dst = [5, 2, 9], [1, 12, 13]
    pool = KVPool.allocate(lay, 16)
    side = open_consumer(_config(NodeRole.DECODE, "d-direct", redis_url), kv_caches=pool.kv_caches, inbox=True)
    consumer = side.consumer
    results = CTX.Queue()
    proc = CTX.Process(target=peer.produce, args=(redis_url, ConnectorKind.TCP, lay, [(rid, tokens, src)], False,
                                                  10.0, results),
                       kwargs={"num_blocks": 16, "node_id": "p-direct",
                               "consumer_endpoint": consumer.kv_ready_endpoint})
    try:
        proc.start()
        assert results.get(timeout=30) == ("published", 1)
        assert consumer.inbox_socket.poll(5000), "no KVReady in the inbox"
        record = consumer.expect(rid, producer="p-direct")  # told directly: the directory waits its head start
        assert consumer.ready() == [rid], "settled by the inbox's KVReady, read by ready()"
        assert record.location is not None and record.location.producer == "p-direct"
        assert record.location.block_ids == src
        hidden, bypass, _ = consumer.receive_batch(ModelInput([SequenceInput(rid, [0] * tokens, 0, dst)]))
        assert bypass
        assert torch.equal(pool.data[dst], peer.request_kv(rid, lay, len(src)))
        assert peer.received_as_sent(hidden, rid, tokens)
        assert record.stats is not None and record.stats.kv_bytes > 0 and record.stats.producer == "p-direct"
        assert results.get(timeout=30) == ("released", {rid: src})
        proc.join(30)
        assert proc.exitcode == 0
        assert consumer.ready() == [], "the owner is told once"
        directory = KVDirectory(redis_url)
        try:
            assert directory.request_ids() == [], "the producer deletes the entry once the pull is confirmed"
        finally:
            directory.close()
    finally:
        side.close()
        proc.join(5)
        proc.kill()


def test_the_inbox_drops_what_is_not_a_kv_ready_and_keeps_reading(redis_url):
    """A malformed message, or another message type, in the inbox is counted and dropped; the KVReady after it
    still settles its request."""
    side = open_consumer(_config(NodeRole.DECODE, "d-inbox", redis_url, deadline_s=5.0), layout=peer.layout(),
                         num_blocks=8, inbox=True)
    consumer = side.consumer
    rejected = process_metrics().messages_rejected.labels("malformed")
    before = rejected._value.get()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(consumer.kv_ready_endpoint)
    try:
        record = consumer.expect("inbox-1", producer="p")
        wrong_kind = pack(CancelWork(request_id="inbox-1"))
        for frame in (b"not msgpack", wrong_kind, pack(KVReady(location=_location("inbox-1")))):
            push.send(frame)
        told = _ready_with_inbox(consumer, 1, 5.0)
        assert told == ["inbox-1"] and record.location == _location("inbox-1")
        assert rejected._value.get() - before == 2
    finally:
        push.close(0)
        side.close()


def test_a_consumer_told_directly_gives_its_kv_ready_a_head_start_by_itself(redis_url):
    """The head start is the consumer's policy: with an inbox and a named producer the directory is first read
    DIRECT_HEAD_START_S after `expect`; without an inbox, at once."""
    told, untold = (open_consumer(_config(NodeRole.DECODE, f"d-policy-{i}", redis_url, deadline_s=5.0),
                                  layout=peer.layout(), num_blocks=8, inbox=i == 0) for i in range(2))
    try:
        told.directory.fail("policy-told", "refused", producer="p")
        told.directory.fail("policy-untold", "refused", producer="p")
        start = time.monotonic()
        told.consumer.expect("policy-told", producer="p")
        untold.consumer.expect("policy-untold", producer="p")
        when_untold = dict(_ready_as_told(untold.consumer, 1, 3.0))["policy-untold"]
        when_told = dict(_ready_with_inbox(told.consumer, 1, 3.0, stamped=True))["policy-told"]
        assert when_untold - start < DIRECT_HEAD_START_S
        assert when_told - start >= DIRECT_HEAD_START_S
    finally:
        told.close()
        untold.close()


def _ready_with_inbox(consumer, want: int, timeout_s: float, stamped: bool = False) -> list:
    """`ready()` as a decode node's loop reads it: woken by the consumer's fd or its inbox socket."""
    poller = zmq.Poller()
    poller.register(consumer.wakeup.fd, zmq.POLLIN)
    poller.register(consumer.inbox_socket, zmq.POLLIN)
    told: list = []
    deadline = time.monotonic() + timeout_s
    while len(told) < want and (left := deadline - time.monotonic()) > 0:
        poller.poll(left * 1000)
        consumer.wakeup.drain()
        now = time.monotonic()
        told += [(rid, now) if stamped else rid for rid in consumer.ready()]
    return told


def test_a_head_start_keeps_the_directory_unread_until_it_ends_and_a_kv_ready_skips_it(redis_url, monkeypatch):
    """With a head start (a decode node's producer tells it directly), the watcher reads the directory only once
    it has passed: a FAILED entry is seen then, not at once, and a KVReady within it settles the request with
    no directory read at all. Without one, the FAILED entry is seen at once."""
    side = _consumer("d-head", redis_url)
    consumer, head_s = side.consumer, 0.3
    reads: list[str] = []
    look = side.directory.look

    def counted_look(rids):
        rids = list(rids)
        reads.extend(rids)
        return look(rids)

    monkeypatch.setattr(side.directory, "look", counted_look)
    loc = _location("head-kv-ready")
    try:
        for rid in ("head-failed", "no-head-failed"):
            side.directory.fail(rid, "the prefill node refused it", producer="p")
        start = time.monotonic()
        failed = consumer.expect("head-failed", producer="p", head_start_s=head_s)
        at_once = consumer.expect("no-head-failed", producer="p")
        word = consumer.expect("head-kv-ready", producer="p", head_start_s=head_s)
        assert consumer.take_kv_ready(loc)
        when = dict(_ready_as_told(consumer, 3, 3.0))
        assert set(when) == {"head-failed", "no-head-failed", "head-kv-ready"}
        assert when["no-head-failed"] - start < head_s and when["head-kv-ready"] - start < head_s
        assert when["head-failed"] - start >= head_s
        assert failed.location is None and at_once.location is None and word.location == loc
        time.sleep(0.05)
        assert "head-kv-ready" not in reads, "the KVReady came within the head start: no directory read"
    finally:
        side.close()
