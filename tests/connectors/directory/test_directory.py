"""KVDirectory and Heartbeat against a real redis-server."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from kvwire.cluster.redis_server import LocalRedis
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import (
    LEGAL_TRANSITIONS,
    TERMINAL_STATES,
    DirectoryError,
    KVDirectory,
    StaleNodeError,
    TransferState,
)
from kvwire.connectors.directory.heartbeat import Heartbeat
from kvwire.connectors.wire import DType, KVLayout, KVLocation, NodeInfo, TensorDesc

S = TransferState
EDGES = [(src, dst) for src, dsts in LEGAL_TRANSITIONS.items() for dst in sorted(dsts)]
ILLEGAL = [(src, dst) for src in S for dst in S if dst not in LEGAL_TRANSITIONS[src]]


def location(request_id: str, producer: str = "prefill-0") -> KVLocation:
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=DType.FLOAT16)
    return KVLocation(
        request_id=request_id, producer=producer, producer_epoch=3, kind=ConnectorKind.UCX,
        side_channel="tcp://127.0.0.1:5555", transport_address=b"\x00ucx\xff", layout=layout,
        block_ids=[7, 8, 9], num_tokens=40, hidden=[TensorDesc("hidden", DType.FLOAT16, (40, 256))],
    )  # fmt: skip


def node(node_id: str, role: NodeRole, epoch: int = 0, free_blocks: int = 10) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, epoch=epoch, work_endpoint=f"tcp://127.0.0.1/{node_id}",
                    connector=ConnectorKind.UCX, free_blocks=free_blocks, total_blocks=100)  # fmt: skip


def bring_to(directory: KVDirectory, rid: str, state: TransferState) -> None:
    """Drive a fresh request through legal edges to `state`."""
    assert directory.create_pending(rid, "prefill-0")
    if state in (S.READY, S.CONSUMED):
        assert directory.publish_ready(location(rid))
    if state is not S.PENDING and state is not S.READY:
        src = S.READY if state is S.CONSUMED else S.PENDING
        assert directory.transition(rid, [src], state, reason=f"to {state}")
    assert directory.get(rid).state is state


def blocked_clients(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("clients")["blocked_clients"])
    finally:
        client.close()


@pytest.fixture
def raw(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


# --- state machine ---------------------------------------------------------------------------


def test_create_pending_is_nx(directory: KVDirectory) -> None:
    assert directory.get("r1") is None
    assert directory.create_pending("r1", "prefill-0") is True
    assert directory.create_pending("r1", "prefill-1") is False
    entry = directory.get("r1")
    assert (entry.request_id, entry.state, entry.producer, entry.location, entry.reason) == (
        "r1", S.PENDING, "prefill-0", None, "")


@pytest.mark.parametrize("pending_first", [True, False], ids=["from-pending", "from-absent"])
def test_publish_ready_stores_location_intact(directory: KVDirectory, pending_first: bool) -> None:
    if pending_first:
        directory.create_pending("r1", "prefill-7")
    loc = location("r1", producer="prefill-7")
    assert directory.publish_ready(loc) is True
    entry = directory.get("r1")
    assert entry.state is S.READY and entry.producer == "prefill-7"
    assert entry.location == loc and entry.location.transport_address == b"\x00ucx\xff"


@pytest.mark.parametrize("state", [S.READY, *sorted(TERMINAL_STATES)])
def test_publish_ready_refused_unless_pending_or_absent(directory: KVDirectory, state: TransferState) -> None:
    bring_to(directory, "r1", state)
    before = directory.get("r1")
    assert directory.publish_ready(location("r1", producer="other")) is False
    assert directory.get("r1") == before


@pytest.mark.parametrize(("src", "dst"), [e for e in EDGES if e != (S.PENDING, S.READY)], ids=str)
def test_every_legal_edge(directory: KVDirectory, src: TransferState, dst: TransferState) -> None:
    bring_to(directory, "r1", src)
    assert directory.transition("r1", [src], dst, reason="because") is True
    entry = directory.get("r1")
    assert (entry.state, entry.reason) == (dst, "because")
    if src is S.READY:
        assert entry.location == location("r1")  # a later transition keeps the location


@pytest.mark.parametrize(("src", "dst"), ILLEGAL, ids=str)
def test_illegal_edge_raises(directory: KVDirectory, src: TransferState, dst: TransferState) -> None:
    bring_to(directory, "r1", src)
    with pytest.raises(ValueError, match="r1"):
        directory.transition("r1", [src], dst)
    assert directory.get("r1").state is src


def test_transition_argument_errors(directory: KVDirectory) -> None:
    directory.create_pending("r1", "p")
    with pytest.raises(ValueError, match="publish_ready"):
        directory.transition("r1", [S.PENDING], S.READY)
    with pytest.raises(ValueError, match="empty"):
        directory.transition("r1", [], S.FAILED)
    with pytest.raises(ValueError, match="illegal"):  # one bad source spoils the set
        directory.transition("r1", [S.PENDING, S.CONSUMED], S.FAILED)


def test_cas_fails_from_wrong_state_or_absent(directory: KVDirectory) -> None:
    directory.create_pending("r1", "p")
    assert directory.transition("r1", [S.READY], S.CONSUMED) is False
    assert directory.get("r1").state is S.PENDING
    assert directory.transition("nope", [S.PENDING, S.READY], S.FAILED) is False
    assert directory.get("nope") is None and directory.request_ids() == ["r1"]


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_terminal_states_are_final(directory: KVDirectory, state: TransferState) -> None:
    bring_to(directory, "r1", state)
    for to in TERMINAL_STATES:
        sources = [src for src in S if to in LEGAL_TRANSITIONS[src]]
        assert directory.transition("r1", sources, to) is False
    assert directory.create_pending("r1", "p") is False
    assert directory.publish_ready(location("r1")) is False
    assert directory.get("r1").state is state


def test_concurrent_cas_exactly_one_wins(directory: KVDirectory) -> None:
    n = 8
    barrier = threading.Barrier(n)

    def race(call):
        barrier.wait(timeout=5)
        return call()

    with ThreadPoolExecutor(n) as pool:
        created = list(pool.map(lambda i: race(lambda: directory.create_pending("r1", f"p{i}")), range(n)))
        directory.publish_ready(location("r1"))
        outcomes = [S.CONSUMED, S.FAILED] * (n // 2)
        moved = list(pool.map(lambda to: race(lambda: directory.transition("r1", [S.READY], to)), outcomes))
    assert created.count(True) == 1 and moved.count(True) == 1
    assert directory.get("r1").state is outcomes[moved.index(True)]


# --- TTLs, delete, listing -----------------------------------------------------------------------


def test_every_key_has_a_ttl(directory: KVDirectory, raw: redis.Redis) -> None:
    bring_to(directory, "r1", S.CONSUMED)
    directory.create_pending("r2", "p")
    directory.register_node(node("prefill-0", NodeRole.PREFILL, epoch=directory.next_epoch("prefill-0")))
    keys = sorted(k.decode() for k in raw.scan_iter())
    assert {k.split(":")[1] for k in keys} == {"req", "ev", "node", "epoch", "nodes"}  # nodes: the node index
    assert all(raw.pttl(k) > 0 for k in keys), {k: raw.pttl(k) for k in keys}
    assert raw.pttl("kvwire:req:r1") <= 5000 and raw.pttl("kvwire:node:prefill-0") <= 500


def test_transition_refreshes_entry_ttl(directory: KVDirectory, raw: redis.Redis) -> None:
    directory.create_pending("r1", "p")
    for key in raw.scan_iter():
        raw.pexpire(key, 200)
    directory.publish_ready(location("r1"))
    assert all(4000 < raw.pttl(k) <= 5000 for k in raw.scan_iter())


def test_entries_vanish_after_ttl(redis_url: str, raw: redis.Redis) -> None:
    short = KVDirectory(redis_url, entry_ttl_s=0.5)
    try:
        short.create_pending("r1", "p")
        short.publish_ready(location("r2"))
        assert short.request_ids() == ["r1", "r2"]
        time.sleep(0.7)  # let the TTL run out
        assert short.get("r1") is None and short.get("r2") is None
        assert short.request_ids() == [] and list(raw.scan_iter()) == []
    finally:
        short.close()


def test_delete_removes_every_key(directory: KVDirectory, raw: redis.Redis) -> None:
    bring_to(directory, "a:b", S.CONSUMED)  # ids may hold the key separator
    bring_to(directory, "other", S.PENDING)
    directory.delete("a:b")
    assert directory.get("a:b") is None
    assert sorted(k.decode() for k in raw.scan_iter()) == ["kvwire:ev:other", "kvwire:req:other"]
    assert directory.request_ids() == ["other"]


def test_namespaces_are_isolated(redis_url: str, directory: KVDirectory) -> None:
    other = KVDirectory(redis_url, namespace="blue")
    try:
        other.create_pending("r1", "p")
        assert directory.get("r1") is None and directory.request_ids() == []
        assert other.request_ids() == ["r1"]
    finally:
        other.close()
    with pytest.raises(ValueError):
        KVDirectory(redis_url, namespace="a*b")
    with pytest.raises(ValueError):
        KVDirectory(redis_url, entry_ttl_s=0)


# --- wait_for ---------------------------------------------------------------------------------


def run_waiter(directory: KVDirectory, rid: str, states, timeout_s: float = 5.0):
    """Start wait_for in a thread; the result holds (entry, monotonic time it returned)."""
    result: list = []
    deadline = time.monotonic() + timeout_s
    thread = threading.Thread(target=lambda: result.append((directory.wait_for(rid, states, deadline),
                                                            time.monotonic())))  # fmt: skip
    thread.start()
    return thread, result


def test_wait_for_wakes_promptly(directory: KVDirectory, redis_url: str) -> None:
    directory.create_pending("r1", "p")
    thread, result = run_waiter(directory, "r1", [S.READY])
    time.sleep(0.3)
    assert thread.is_alive() and blocked_clients(redis_url) == 1  # it blocks in Redis
    published = time.monotonic()
    directory.publish_ready(location("r1"))
    thread.join(timeout=5)
    entry, woke = result[0]
    assert entry.state is S.READY and entry.location == location("r1")
    assert woke - published < 0.5


def test_a_ready_event_carries_the_entry_so_the_waiter_reads_nothing_more(directory: KVDirectory,
                                                                           raw: redis.Redis) -> None:
    directory.create_pending("r1", "p")
    thread, result = run_waiter(directory, "r1", [S.READY])
    time.sleep(0.3)
    reads = raw.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    directory.publish_ready(location("r1"))
    thread.join(timeout=5)
    entry, _ = result[0]
    assert entry.state is S.READY and entry.producer == "prefill-0" and entry.location == location("r1")
    assert raw.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0) == reads  # no second read


def test_every_waiter_wakes(directory: KVDirectory) -> None:
    """Consumers awaiting READY and a producer awaiting CONSUMED, all at once."""
    directory.create_pending("r1", "p")
    consumers = [run_waiter(directory, "r1", [S.READY]) for _ in range(3)]
    producer, produced = run_waiter(directory, "r1", [S.CONSUMED])
    time.sleep(0.2)
    directory.publish_ready(location("r1"))
    for thread, result in consumers:
        thread.join(timeout=1)
        assert result and result[0][0].state is S.READY
    assert producer.is_alive()  # READY is not what it waits for
    directory.transition("r1", [S.READY], S.CONSUMED)
    producer.join(timeout=1)
    assert produced[0][0].state is S.CONSUMED


def test_wait_for_returns_terminal_state_it_did_not_ask_for(directory: KVDirectory) -> None:
    directory.create_pending("r1", "p")
    thread, result = run_waiter(directory, "r1", [S.READY])
    time.sleep(0.1)
    directory.transition("r1", [S.PENDING], S.FAILED, reason="producer out of blocks")
    thread.join(timeout=1)
    assert (result[0][0].state, result[0][0].reason) == (S.FAILED, "producer out of blocks")


def test_wait_for_entry_created_later(directory: KVDirectory) -> None:
    thread, result = run_waiter(directory, "late", [S.READY])
    time.sleep(0.1)
    directory.publish_ready(location("late"))
    thread.join(timeout=1)
    assert result[0][0].state is S.READY


@pytest.mark.parametrize("exists", [True, False])
def test_wait_for_times_out(directory: KVDirectory, exists: bool) -> None:
    if exists:
        directory.create_pending("r1", "p")
    start = time.monotonic()
    assert directory.wait_for("r1", [S.READY], start + 0.3) is None
    assert 0.3 <= time.monotonic() - start < 0.6


def test_wait_for_deadline_in_the_past_looks_once(directory: KVDirectory) -> None:
    directory.create_pending("pending", "p")
    directory.publish_ready(location("ready"))
    start = time.monotonic()
    assert directory.wait_for("pending", [S.READY], start - 1) is None
    assert directory.wait_for("ready", [S.READY], start - 1).location == location("ready")
    assert time.monotonic() - start < 0.1


# --- node registry ----------------------------------------------------------------------------


def test_register_and_list_nodes(directory: KVDirectory) -> None:
    nodes = [node("prefill-1", NodeRole.PREFILL), node("decode-0", NodeRole.DECODE),
             node("prefill-0", NodeRole.PREFILL)]  # fmt: skip
    for info in nodes:
        directory.register_node(info)
    assert [n.node_id for n in directory.live_nodes()] == ["decode-0", "prefill-0", "prefill-1"]
    assert [n.node_id for n in directory.live_nodes(NodeRole.PREFILL)] == ["prefill-0", "prefill-1"]
    assert directory.live_nodes(NodeRole.DECODE) == [nodes[1]]
    assert directory.get_node("prefill-1") == nodes[0] and directory.get_node("ghost") is None
    directory.deregister_node("prefill-1")
    assert [n.node_id for n in directory.live_nodes()] == ["decode-0", "prefill-0"]


def test_node_expires_without_heartbeats(directory: KVDirectory) -> None:
    directory.register_node(node("decode-0", NodeRole.DECODE))
    time.sleep(0.7)  # node_ttl_s is 0.5
    assert directory.get_node("decode-0") is None and directory.live_nodes() == []


def test_listing_nodes_reads_the_index_not_the_keyspace(directory: KVDirectory, redis_url: str) -> None:
    """Request entries beside the nodes cost a listing nothing: no SCAN, and the same commands with 1 or 300."""
    client = redis.Redis.from_url(redis_url)
    directory.register_node(node("decode-0", NodeRole.DECODE))
    directory.register_node(node("prefill-0", NodeRole.PREFILL))

    def commands_of_a_listing() -> dict[str, int]:
        before = client.info("commandstats")
        assert [n.node_id for n in directory.live_nodes()] == ["decode-0", "prefill-0"]
        after = client.info("commandstats")
        spent = {k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after}
        return {k: v for k, v in spent.items() if v and k != "cmdstat_info"}

    directory.publish_ready(location("r-0"))
    few = commands_of_a_listing()
    for i in range(1, 300):
        directory.publish_ready(location(f"r-{i}"))
    assert commands_of_a_listing() == few and "cmdstat_scan" not in few
    client.close()


def test_a_node_gone_leaves_the_index(directory: KVDirectory, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    directory.register_node(node("decode-0", NodeRole.DECODE))
    directory.register_node(node("decode-1", NodeRole.DECODE))
    directory.deregister_node("decode-1")
    assert client.zrange(f"{directory.namespace}:nodes", 0, -1) == [b"decode-0"]
    time.sleep(0.7)  # node_ttl_s is 0.5: decode-0's record expires; the next listing drops it from the index
    assert directory.live_nodes() == [] and client.zrange(f"{directory.namespace}:nodes", 0, -1) == []
    client.close()


def test_heartbeat_keeps_node_alive_with_fresh_load(directory: KVDirectory) -> None:
    beats = iter(range(1000))
    beat = Heartbeat(directory, lambda: node("decode-0", NodeRole.DECODE, free_blocks=next(beats)))
    beat.start()
    try:
        assert directory.get_node("decode-0") is not None  # registered by start()
        time.sleep(1.2)  # over twice node_ttl_s
        alive = directory.get_node("decode-0")
        assert alive is not None and alive.free_blocks >= 3  # refreshed every node_ttl_s/3
    finally:
        beat.stop()
    assert directory.get_node("decode-0") is None  # stop() deregisters


def test_next_epoch_increases_and_stale_epochs_are_refused(directory: KVDirectory) -> None:
    first, second = directory.next_epoch("prefill-0"), directory.next_epoch("prefill-0")
    assert second > first and directory.next_epoch("prefill-1") == 1
    directory.register_node(node("prefill-0", NodeRole.PREFILL, epoch=second))
    with pytest.raises(StaleNodeError, match="prefill-0") as info:
        directory.heartbeat(node("prefill-0", NodeRole.PREFILL, epoch=first, free_blocks=0))
    assert isinstance(info.value, DirectoryError)
    assert directory.get_node("prefill-0").epoch == second


# --- Redis down -------------------------------------------------------------------------------


@pytest.fixture
def crashable():
    with LocalRedis(password="s3cret") as server:
        yield server


def test_directory_error_when_redis_is_down(crashable: LocalRedis) -> None:
    directory = KVDirectory(crashable.url)
    try:
        directory.create_pending("r1", "p")
        crashable.kill()
        calls = [lambda: directory.get("r1"), lambda: directory.transition("r1", [S.PENDING], S.FAILED),
                 lambda: directory.wait_for("r1", [S.READY], time.monotonic() + 1)]  # fmt: skip
        for call in calls:
            start = time.monotonic()
            with pytest.raises(DirectoryError) as info:
                call()
            assert time.monotonic() - start < 2.0
            assert info.value.request_id == "r1" and isinstance(info.value.__cause__, redis.ConnectionError)
            assert f"127.0.0.1:{crashable.port}" in info.value.peer and "s3cret" not in str(info.value)
        with pytest.raises(DirectoryError):
            directory.live_nodes()
        crashable.restart()  # the pool recovers without a new client
        assert directory.get("r1") is None and directory.create_pending("r1", "p")
    finally:
        directory.close()


def test_a_command_to_a_silent_redis_fails_at_the_command_timeout(crashable: LocalRedis) -> None:
    directory = KVDirectory(crashable.url, command_timeout_s=0.3)
    assert crashable.pid is not None
    try:
        directory.create_pending("r1", "p")
        os.kill(crashable.pid, signal.SIGSTOP)  # up, connected, and answering nothing
        start = time.monotonic()
        with pytest.raises(DirectoryError) as info:
            directory.get("r1")
        took = time.monotonic() - start
        assert isinstance(info.value.__cause__, redis.TimeoutError) and 0.3 <= took < 2.0, took
    finally:
        os.kill(crashable.pid, signal.SIGCONT)
        directory.close()
    with pytest.raises(ValueError, match="timeouts must be positive"):
        KVDirectory(crashable.url, command_timeout_s=0)


def test_heartbeat_survives_an_outage(crashable: LocalRedis, caplog: pytest.LogCaptureFixture) -> None:
    directory = KVDirectory(crashable.url, node_ttl_s=0.3)
    beat = Heartbeat(directory, lambda: node("prefill-0", NodeRole.PREFILL))
    beat.start()
    try:
        with caplog.at_level(logging.ERROR, logger="kvwire.connectors.directory.directory"):
            crashable.kill()
            time.sleep(0.3)
        assert any("heartbeat of node prefill-0 failed" in r.getMessage() for r in caplog.records)
        crashable.restart()  # empty: the registration is gone until the next beat
        time.sleep(0.3)
        assert directory.get_node("prefill-0") is not None
    finally:
        beat.stop()
        directory.close()
