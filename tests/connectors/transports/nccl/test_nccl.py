"""NCCL / Gloo transport specifics: many-to-one and one-to-many pairs, pairs rebuilt after a peer died.

Every peer is a real process and every pair a real 2-rank Gloo group (the CPU face of
the NCCL connector); the directory is the session's redis-server.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import ConsumerSide, open_consumer
from kvwire.connectors.transports.nccl.pairs import MAX_PIECES, Backend, backend_for, parse_address, tag_for
from kvwire.connectors.wire import DType
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
NCCL = ConnectorKind.NCCL
LAYOUT = peer.layout(DType.BFLOAT16, layers=4, block_size=4)


def _consumer(redis_url: str, node_id: str = "decode-0", deadline_s: float = 10.0,
              num_blocks: int = 64) -> tuple[ConsumerSide, KVPool]:
    pool = KVPool.allocate(LAYOUT, num_blocks, "cpu")
    side = open_consumer(peer.config(NCCL, NodeRole.DECODE, node_id, redis_url, deadline_s), kv_caches=pool.kv_caches)
    return side, pool


def _links(side: ConsumerSide) -> dict:
    return side.consumer._puller._links  # test-only reach: the puller's live pairs, by producer store address


def _producer(redis_url: str, node_id: str, requests, deadline_s: float = 10.0):
    results = CTX.Queue()
    proc = CTX.Process(target=peer.produce, args=(redis_url, NCCL, LAYOUT, requests, False, deadline_s, results),
                       kwargs={"node_id": node_id})
    proc.start()
    assert results.get(timeout=60) == ("published", len(requests))
    return proc, results


def _pull(side: ConsumerSide, pool: KVPool, rid: str, tokens: int, src: list[int], dst: list[int]) -> bool:
    """Receive one request; True when it bypassed and every byte matches."""
    hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(
        None, ModelInput([SequenceInput(rid, [0] * tokens, 0, dst)]), pool.kv_caches)
    return bool(bypass) and torch.equal(pool.data[dst], peer.request_kv(rid, LAYOUT, len(src))) \
        and peer.received_as_sent(hidden, rid, tokens)


def consume(redis_url: str, node_id: str, requests, dsts, go, results, die_after_request: bool = False) -> None:
    """A consumer process: pull each request when `go` is set; report (node_id, [matched...])."""
    side, pool = _consumer(redis_url, node_id)
    if die_after_request:
        puller = side.consumer._puller
        send = puller._channel.send

        def request_then_die(*args, **kwargs):
            send(*args, **kwargs)
            time.sleep(0.2)  # let zmq flush the request
            os.kill(os.getpid(), signal.SIGKILL)

        puller._channel.send = request_then_die  # test-only: dies before joining the pair's rendezvous
    results.put(("ready", node_id))
    go.wait(60)
    try:
        results.put((node_id, [_pull(side, pool, rid, t, s, d) for (rid, t, s), d in zip(requests, dsts)]))
    finally:
        side.close()


def _finish(proc, results, expected_released: dict[str, list[int]]) -> None:
    assert results.get(timeout=60) == ("released", expected_released)
    proc.join(30)
    assert proc.exitcode == 0


def test_pair_helpers():
    assert parse_address(b"127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_address(b"::1:5000") == ("::1", 5000)
    for bad in (b"", b"host", b"host:", b"host:0", b"host:99999", b":80", b"\xff:x"):
        with pytest.raises(ValueError):
            parse_address(bad)
    assert tag_for(1, 0) != tag_for(2, 0) and tag_for(1, 0) != tag_for(1, 1)
    assert 0 <= tag_for(2**40 + 7, MAX_PIECES - 1) < 2**31
    assert backend_for(torch.device("cpu")) == Backend.GLOO and backend_for(torch.device("cuda:1")) == Backend.NCCL


def test_one_consumer_receives_from_two_producers(redis_url):
    reqs = {p: [(f"{p}-{i}", 4 * (i + 1) - 1, list(range(10 * i, 10 * i + i + 1))) for i in range(4)]
            for p in ("prefill-a", "prefill-b")}
    procs = {p: _producer(redis_url, p, r) for p, r in reqs.items()}
    side, pool = _consumer(redis_url)
    try:
        opened = None
        for i in range(4):  # each batch holds one request of each producer; pairs are reused across batches
            batch = [reqs[p][i] for p in reqs]
            dsts = [list(range(40 + 8 * j, 40 + 8 * j + len(s))) for j, (_, _, s) in enumerate(batch)]
            mi = ModelInput([SequenceInput(rid, [0] * t, 0, d) for (rid, t, _), d in zip(batch, dsts)])
            hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
            assert bypass
            for (rid, t, s), d, rows in zip(batch, dsts, mi.token_slices()):
                assert torch.equal(pool.data[d], peer.request_kv(rid, LAYOUT, len(s)))
                assert peer.received_as_sent(hidden[rows], rid, t)
            links = _links(side)  # one live pair per producer, never reopened
            assert len(links) == 2 and all(link.group is not None for link in links.values())
            opened = opened or {a: link.opened for a, link in links.items()}
            assert opened == {a: link.opened for a, link in links.items()}
        for p, (proc, results) in procs.items():
            _finish(proc, results, {rid: s for rid, _, s in reqs[p]})
    finally:
        side.close()
        for proc, _ in procs.values():
            proc.kill()


def test_one_producer_serves_two_consumers_at_once(redis_url):
    consumers = ("decode-a", "decode-b")
    reqs = {c: [(f"{c}-{i}", 4 * (i + 2) - 2, list(range(20 * k + 5 * i, 20 * k + 5 * i + i + 2)))
                for i in range(4)] for k, c in enumerate(consumers)}
    proc, results = _producer(redis_url, "prefill-0", [r for c in consumers for r in reqs[c]])
    go, out = CTX.Event(), CTX.Queue()
    dsts = {c: [list(range(30, 30 + len(s))) for _, _, s in reqs[c]] for c in consumers}
    kids = [CTX.Process(target=consume, args=(redis_url, c, reqs[c], dsts[c], go, out)) for c in consumers]
    try:
        for kid in kids:
            kid.start()
        assert sorted(out.get(timeout=60) for _ in kids) == [("ready", c) for c in consumers]
        go.set()  # both consumers pull at once: the producer serves them on two lanes
        assert dict(out.get(timeout=60) for _ in kids) == {c: [True] * 4 for c in consumers}
        _finish(proc, results, {rid: s for c in consumers for rid, _, s in reqs[c]})
    finally:
        for p in (*kids, proc):
            p.join(10)
            p.kill()


def test_consumer_pairs_anew_with_a_restarted_producer(redis_url):
    first = [("p1-ok", 8, [0, 1]), ("p1-orphan", 5, [4, 5])]
    proc, _ = _producer(redis_url, "prefill-0", first)
    side, pool = _consumer(redis_url, deadline_s=3.0)
    try:
        assert _pull(side, pool, "p1-ok", 8, [0, 1], [10, 11])
        dead_store = next(iter(_links(side)))
        proc.kill()
        proc.join(10)
        start = time.monotonic()
        assert not _pull(side, pool, "p1-orphan", 5, [4, 5], [12, 13])  # its producer is gone: recompute
        assert time.monotonic() - start < 3.0 + 2.0
        assert dead_store not in _links(side)
        proc, results = _producer(redis_url, "prefill-0", [("p2-ok", 7, [2, 3])])  # same node, new incarnation
        assert _pull(side, pool, "p2-ok", 7, [2, 3], [12, 13])
        assert list(_links(side)) != [dead_store]
        _finish(proc, results, {"p2-ok": [2, 3]})
    finally:
        side.close()
        proc.kill()


def test_pair_is_rebuilt_on_both_sides_after_a_stalled_transfer(redis_url):
    reqs = [("before", 6, [0, 1]), ("stalled", 6, [2, 3]), ("after", 6, [4, 5])]
    proc, results = _producer(redis_url, "prefill-0", reqs, deadline_s=30.0)  # holds its KV long enough
    # Under load (two busy cores) a 1.5 s deadline also failed the pull after the stall, recomputed (counted):
    # the producer, resumed, had not yet failed its stale send and paired anew. Not explained yet; with the stall
    # this long the next pull took 0.02 s in every run.
    deadline_s = 6.0
    side, pool = _consumer(redis_url, deadline_s=deadline_s)
    try:
        assert _pull(side, pool, "before", 6, [0, 1], [20, 21])
        (addr, link), = _links(side).items()
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert not _pull(side, pool, "stalled", 6, [2, 3], [22, 23])
            assert time.monotonic() - start < deadline_s + 1.5
            assert _links(side) == {}  # the consumer discarded its side of the pair
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # The producer's stale send fails on the closed pair, so it drops its side too and rebuilds for this pull.
        assert _pull(side, pool, "after", 6, [4, 5], [22, 23])
        assert _links(side)[addr].opened > link.opened
        _finish(proc, results, {rid: s for rid, _, s in reqs})
    finally:
        side.close()
        proc.kill()


def test_producer_survives_a_consumer_killed_mid_pull(redis_url):
    deadline_s = 4.0
    go, out = CTX.Event(), CTX.Queue()
    kid = CTX.Process(target=consume, args=(redis_url, "decode-doomed", [("doomed", 6, [0, 1])], [[5, 6]], go, out),
                      kwargs={"die_after_request": True})
    kid.start()
    assert out.get(timeout=60) == ("ready", "decode-doomed")  # started first: the producer's holds are short
    proc, results = _producer(redis_url, "prefill-0", [("doomed", 6, [0, 1]), ("fine", 6, [2, 3])], deadline_s)
    side, pool = _consumer(redis_url, "decode-fine")
    try:
        go.set()
        kid.join(30)
        assert kid.exitcode == -signal.SIGKILL
        # The producer's lane for the dead consumer now waits for it at the rendezvous until the job's deadline.
        start = time.monotonic()
        assert _pull(side, pool, "fine", 6, [2, 3], [7, 8])  # ... and holds no other consumer up
        assert time.monotonic() - start < 1.0
        _finish(proc, results, {"doomed": [0, 1], "fine": [2, 3]})  # the dead consumer's pull ended by its deadline
    finally:
        side.close()
        proc.kill()
        kid.kill()
