"""The producer's transfer server (with UCX's send engine) keeps serving through malformed and hostile pulls."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import DirectoryError
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.producer import transfer_server
from kvwire.connectors.producer.held import HeldRequest, HeldTable
from kvwire.connectors.producer.transfer_server import TransferServer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.transport import Refused, SendEngine, SendJob
from kvwire.connectors.transports.ucx.send_engine import UCXSendEngine
from kvwire.connectors.wire import WIRE_VERSION, KVLocation, PullReply, PullRequest, ShmHello, decode, encode
from tests.connectors import peer


@pytest.fixture
def server():
    pool = KVPool.allocate(peer.layout(), 8)
    released: list[tuple[str, list[int]]] = []
    held = HeldTable(lambda rid, blocks: released.append((rid, blocks)))
    endpoints = {"c": b"x"}  # what the directory would say each consumer published
    srv = TransferServer("127.0.0.1", KVRegion.from_kv_caches(pool.kv_caches), held, UCXSendEngine(), 5.0,
                         endpoints.get)
    srv.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.side_channel)
    yield srv, held, released, sock
    sock.close(0)
    srv.close()


def _pull(rid: str, dst: list[int]) -> bytes:
    return encode(PullRequest(request_id=rid, transfer_id=1, consumer="c", transport_address=b"x", dst_block_ids=dst))


def _hold(held: HeldTable, rid: str, blocks: list[int]) -> None:
    loc = KVLocation(request_id=rid, producer="p", producer_epoch=1, kind=ConnectorKind.UCX, side_channel="",
                     transport_address=b"", layout=peer.layout(), block_ids=blocks, num_tokens=4, hidden=[])
    held.add(HeldRequest(loc, [], deadline=1e18))


def _reply(sock) -> PullReply:
    assert sock.poll(5000), "no reply"
    return decode(sock.recv(), expect=PullReply)


def test_garbage_is_dropped_and_counted_then_server_answers(server):
    srv, held, released, sock = server
    junk = [b"", b"\xff" * 40, _pull("a", [1])[:-2], msgspec.msgpack.encode([WIRE_VERSION + 1, {"type": "pull"}]),
            encode(PullReply(request_id="x", transfer_id=1, ok=True)),
            encode(ShmHello(consumer="c", transport_address=b"a"))]  # valid, but not for this socket
    for j in junk:
        sock.send(j)
    sock.send(_pull("unknown", [1]))
    reply = _reply(sock)
    assert reply.request_id == "unknown" and not reply.ok and "unknown" in reply.reason
    assert srv.rejected_messages == len(junk)


def test_block_count_mismatch_is_refused_and_the_request_stays_pullable(server):
    _, held, released, sock = server
    _hold(held, "r", [0, 1])
    sock.send(_pull("r", [5]))
    reply = _reply(sock)
    assert not reply.ok and "destination blocks" in reply.reason
    # a bad (or forged) pull must not make the producer drop the KV its real consumer will pull;
    # the hold deadline still releases it if nobody does
    assert released == [] and len(held) == 1 and held.begin_pull("r") is not None


def test_a_pick_of_blocks_not_held_for_the_request_is_refused(server):
    _, held, released, sock = server
    _hold(held, "r3", [2, 3, 4])
    for transfer_id, src in enumerate(([2, 5], [2, 3, 4]), start=1):  # another request's block; one too many
        sock.send(encode(PullRequest(request_id="r3", transfer_id=transfer_id, consumer="c", transport_address=b"x",
                                     dst_block_ids=[6, 7], src_block_ids=src)))
        reply = _reply(sock)
        assert not reply.ok and ("not held" in reply.reason or "destination blocks" in reply.reason), reply.reason
    assert released == [] and len(held) == 1


def test_address_the_consumer_did_not_publish_is_refused(server):
    _, held, released, sock = server
    _hold(held, "r2", [3])
    # b"\xff..." is no UCX worker address: connecting to it would abort the process
    sock.send(encode(PullRequest(request_id="r2", transfer_id=1, consumer="c", transport_address=b"\xff" * 64,
                                 dst_block_ids=[4])))
    reply = _reply(sock)
    assert not reply.ok and "not the one it published" in reply.reason
    assert released == [] and len(held) == 1  # still there for the consumer that did publish
    sock.send(encode(PullRequest(request_id="r2", transfer_id=2, consumer="nobody", transport_address=b"x",
                                 dst_block_ids=[4])))
    assert not _reply(sock).ok


def test_a_directory_that_fails_keeps_a_verified_consumer_and_refuses_the_rest(monkeypatch):
    """A lookup that times out (a stalled redis-server) must not refuse a consumer verified before: its last
    verified address stands. A consumer never verified, or one whose address changed, is refused."""
    monkeypatch.setattr(transfer_server, "TRUST_TTL_S", 0.0)  # every pull looks the consumer up
    published: dict[str, bytes] = {"c": b"x"}
    directory_up = True

    def lookup(consumer: str) -> bytes | None:
        if not directory_up:
            raise DirectoryError("get transport address: TimeoutError: Timeout reading from socket")
        return published.get(consumer)

    held = HeldTable(lambda rid, blocks: None)
    srv = TransferServer("127.0.0.1", KVRegion.from_kv_caches(KVPool.allocate(peer.layout(), 8).kv_caches), held,
                         UCXSendEngine(), 5.0, lookup)
    try:
        def claim(rid: str, consumer: str) -> SendJob | str:  # the refusal's reason
            _hold(held, rid, [1])
            job = srv.claim(PullRequest(request_id=rid, transfer_id=1, consumer=consumer, transport_address=b"x",
                                        dst_block_ids=[2]))
            return job.reason if isinstance(job, Refused) else job

        assert isinstance(claim("r1", "c"), SendJob)  # verified
        directory_up = False
        assert isinstance(claim("r2", "c"), SendJob)  # the directory failed, not the consumer
        assert "cannot verify" in claim("r3", "d")  # never verified
        directory_up, published["c"] = True, b"y"
        assert "not the one it published" in claim("r4", "c")  # c restarted at another address
        directory_up = False
        assert "cannot verify" in claim("r5", "c")  # its old address is no fallback
    finally:
        srv.close()


class _SettlingEngine(SendEngine):
    """A transport whose every pull stalls, and which may still read an abandoned pull's pieces until the test
    says it is done (UCX's parked links: connectors/transports/ucx/send_engine.py)."""

    def __init__(self) -> None:
        self.abandoned: list[SendJob] = []

    def start(self, job: SendJob) -> None:
        pass

    def abandon(self, job: SendJob) -> bool:
        self.abandoned.append(job)
        return True


def test_an_abandoned_pull_whose_sends_may_land_keeps_its_blocks_until_they_settled():
    """The consumer is answered at the deadline, but the blocks stay held (a late send must read the request's own
    bytes) until the engine says it no longer reads them; and a pull that failed is never reported delivered."""
    released: list[tuple[str, list[int]]] = []
    delivered: list[PullRequest] = []
    held = HeldTable(lambda rid, blocks: released.append((rid, blocks)))
    engine = _SettlingEngine()
    deadline_s = 0.2
    srv = TransferServer("127.0.0.1", KVRegion.from_kv_caches(KVPool.allocate(peer.layout(), 8).kv_caches), held,
                         engine, deadline_s, {"c": b"x"}.get, on_delivered=lambda msg, n: delivered.append(msg))
    srv.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.side_channel)
    try:
        _hold(held, "late", [2, 3])
        sock.send(_pull("late", [4, 5]))
        reply = _reply(sock)
        assert not reply.ok and "deadline" in reply.reason
        assert [j.msg.request_id for j in engine.abandoned] == ["late"]
        assert srv.settling == 1 and released == [] and len(held) == 1
        assert held.begin_pull("late", "other") is None  # still in flight: nobody else takes it either
        srv.settled(engine.abandoned[0])
        end = time.monotonic() + 5.0
        while not released and time.monotonic() < end:
            time.sleep(0.01)
        assert released == [("late", [2, 3])]
        assert srv.settling == 0 and delivered == []
    finally:
        sock.close(0)
        srv.close()
