"""Shared-memory transport specifics: privacy, cleanup after close and after a crash, consumers that vanish.

The round trips themselves are the conformance suite's (`--connector shm`).
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import ConsumerSide, ProducerSide, open_consumer, open_producer
from kvwire.connectors.transports.shm.channel import (
    close_fds,
    connect,
    node_prefix,
    recv_msg,
    remove_stale,
    send_msg,
    socket_dir,
)
from kvwire.connectors.wire import KVLocation, PullReply, PullRequest, ShmHello, ShmReadDone, ShmSegment
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
NODE = "shm-test-producer"
SYSTEM_PYTHON = Path("/usr/bin/python3")


def _config(role: NodeRole, node_id: str, redis_url: str, deadline_s: float):
    return peer.config(ConnectorKind.SHM, role, node_id, redis_url, deadline_s)


@contextmanager
def _producer(redis_url: str, node_id: str = NODE, deadline_s: float = 5.0):
    """A producer over a shared-memory pool; yields (side, its pool, a queue of (request_id, block_ids) released)."""
    side = open_producer(_config(NodeRole.PREFILL, node_id, redis_url, deadline_s), layout=peer.layout(),
                         num_blocks=16)
    released = peer.Releases(side.producer)
    try:
        yield side, peer.pool_of(side.kv_caches), released
    finally:
        side.close()


@contextmanager
def _consumer(redis_url: str, deadline_s: float = 5.0):
    pool = KVPool.allocate(peer.layout(), 16, "cpu")
    side = open_consumer(_config(NodeRole.DECODE, "shm-test-consumer", redis_url, deadline_s),
                         kv_caches=pool.kv_caches)
    try:
        yield side, pool
    finally:
        side.close()


def _publish(side: ProducerSide, pool: KVPool, rid: str, blocks: list[int], tokens: int) -> None:
    pool.data[blocks] = peer.request_kv(rid, pool.layout, len(blocks))
    side.connector.send_kv_caches_and_hidden_states(None, ModelInput([SequenceInput(rid, [0] * tokens, 0, blocks)]),
                                                    side.kv_caches, peer.request_hidden(rid, tokens, False))


def _pull_and_check(side: ConsumerSide, pool: KVPool, rid: str, dst: list[int], tokens: int) -> None:
    mi = ModelInput([SequenceInput(rid, [0] * tokens, 0, dst)])
    hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
    assert bypass, f"{rid} was not received"
    assert torch.equal(pool.data[dst], peer.request_kv(rid, pool.layout, len(dst)))
    assert peer.received_as_sent(hidden, rid, tokens)


def _engine(side: ProducerSide):
    return side.producer._servers[ConnectorKind.SHM]._engine  # test-only reach into the transfer server


def _segment(side: ProducerSide):
    return side.producer._transport._segment  # test-only reach: the pool's shared-memory segment


def _maps(side: ConsumerSide) -> dict:
    return side.consumer._puller._maps  # test-only reach: the producers' pools the puller has mapped


def _node_sockets(node_id: str) -> list[str]:
    prefix = node_prefix(node_id) + "."
    return sorted(p.name for p in socket_dir().iterdir() if p.name.startswith(prefix))


def _dev_shm() -> set[str]:
    """/dev/shm's files, less POSIX semaphores (multiprocessing's, ours and other test runs')."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def _memfds() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if "memfd:kvwire" in link]


def _location(redis_url: str, rid: str) -> KVLocation:
    directory = KVDirectory(redis_url)
    try:
        return directory.get(rid).location
    finally:
        directory.close()


# --- privacy -------------------------------------------------------------------------------


def test_socket_directory_socket_and_pool_descriptor_are_private(redis_url):
    with _producer(redis_url) as (conn, _, _):
        path = _engine(conn).path
        dir_stat, sock_stat = os.lstat(path.parent), os.lstat(path)
        assert stat.S_ISDIR(dir_stat.st_mode) and stat.S_IMODE(dir_stat.st_mode) == 0o700
        assert dir_stat.st_uid == os.getuid()
        assert stat.S_ISSOCK(sock_stat.st_mode) and stat.S_IMODE(sock_stat.st_mode) == 0o600
        msg, fds = _segment(conn).export()
        assert os.fstat(fds[0]).st_nlink == 0, "the pool has no name anywhere"
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith(f"/memfd:kvwire-{NODE}-")
        assert fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY, "consumers get a read-only fd"
        assert fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK, "consumers cannot shrink it"
        assert not [n for n in _dev_shm() if "kvwire" in n]


def test_a_socket_directory_others_can_enter_is_refused(tmp_path):
    (tmp_path / f"kvwire-{os.getuid()}").mkdir(mode=0o755)
    os.chmod(tmp_path / f"kvwire-{os.getuid()}", 0o755)
    with pytest.raises(PermissionError, match="0700"):
        socket_dir(tmp_path)


_PROBE = """
import json, os, socket, sys
out = {}
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(sys.argv[1]); out["connect"] = "connected"
except OSError as e:
    out["connect"] = type(e).__name__
try:
    open(sys.argv[2], "rb").close(); out["pool"] = "opened"
except OSError as e:
    out["pool"] = type(e).__name__
print(json.dumps(out))
"""


@pytest.mark.skipif(os.getuid() != 0 or not SYSTEM_PYTHON.exists(),
                    reason="switching to another user needs root and a system python3")
def test_another_user_can_neither_connect_nor_open_the_pool(redis_url):
    with _producer(redis_url) as (conn, _, _):
        pool_fd = f"/proc/{os.getpid()}/fd/{_segment(conn)._fd}"
        args = [str(SYSTEM_PYTHON), "-c", _PROBE, str(_engine(conn).path), pool_fd]
        done = subprocess.run(args, user=65534, group=65534, extra_groups=[], capture_output=True, timeout=30,
                              cwd="/", env={})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"connect": "PermissionError", "pool": "PermissionError"}


# --- cleanup ---------------------------------------------------------------------------------


def test_close_leaves_no_socket_no_descriptor_and_no_mapping(redis_url):
    shm_before = _dev_shm()
    with _consumer(redis_url) as (consumer, cpool):
        with _producer(redis_url) as (producer, pool, released):
            path = _engine(producer).path
            _publish(producer, pool, "c1", [3, 4, 9], 10)
            _pull_and_check(consumer, cpool, "c1", [7, 1, 2], 10)
            assert released.get(timeout=5) == ("c1", [3, 4, 9])
            del pool
        assert not path.exists() and _node_sockets(NODE) == []
    del producer, consumer, released  # released reads the producer: it holds it too
    gc.collect()
    assert _memfds() == [], "descriptors left open"
    assert "memfd:kvwire" not in Path("/proc/self/maps").read_text(), "a mapping outlived its connectors"
    assert _dev_shm() == shm_before


def _produce_and_wait(redis_url: str, node_id: str, results) -> None:
    side = open_producer(_config(NodeRole.PREFILL, node_id, redis_url, 30.0), layout=peer.layout(), num_blocks=16)
    _publish(side, peer.pool_of(side.kv_caches), "crash-1", [2, 5], 6)
    results.put(str(_engine(side).path))
    threading.Event().wait(120)  # a victim: the test SIGKILLs it long before this


def test_sigkilled_producer_leaves_only_a_socket_the_next_incarnation_removes(redis_url):
    shm_before = _dev_shm()
    results = CTX.Queue()
    proc = CTX.Process(target=_produce_and_wait, args=(redis_url, NODE, results))
    proc.start()
    try:
        stale = Path(results.get(timeout=60))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    finally:
        proc.kill()
    assert stale.exists(), "a SIGKILLed producer cannot remove its socket"
    assert _dev_shm() == shm_before, "the memfd pool leaves nothing in /dev/shm"
    with _consumer(redis_url) as (consumer, cpool):
        with _producer(redis_url) as (producer, pool, _):
            assert not stale.exists(), "the next incarnation removes the dead one's socket"
            assert _node_sockets(NODE) == [_engine(producer).path.name]
            _publish(producer, pool, "after-crash", [0, 1], 8)
            _pull_and_check(consumer, cpool, "after-crash", [5, 6], 8)
    assert _node_sockets(NODE) == []


def test_consumer_unmaps_a_producer_that_died(redis_url):
    doomed = "shm-test-doomed"
    results = CTX.Queue()
    proc = CTX.Process(target=_produce_and_wait, args=(redis_url, doomed, results))
    proc.start()
    try:
        results.get(timeout=60)
        with _consumer(redis_url) as (consumer, cpool):
            _pull_and_check(consumer, cpool, "crash-1", [9, 3], 6)
            assert doomed in _maps(consumer)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            with _producer(redis_url) as (producer, pool, _):
                _publish(producer, pool, "next", [0], 2)
                _pull_and_check(consumer, cpool, "next", [1], 2)
            assert doomed not in _maps(consumer), "a dead producer's mapping is dropped at the next pull"
            gc.collect()
            assert f"memfd:kvwire-{doomed}-" not in Path("/proc/self/maps").read_text()
    finally:
        proc.kill()
        remove_stale(socket_dir(), doomed)


def test_a_new_producer_epoch_is_mapped_afresh(redis_url):
    with _consumer(redis_url) as (consumer, cpool):
        for epoch_run in range(2):
            with _producer(redis_url) as (producer, pool, _):
                rid = f"epoch-run-{epoch_run}"
                _publish(producer, pool, rid, [4], 3)
                epoch = _location(redis_url, rid).producer_epoch  # this incarnation's
                _pull_and_check(consumer, cpool, rid, [8], 3)
                assert _maps(consumer)[NODE].epoch == epoch


# --- consumers that vanish, stall or lie about who they are --------------------------------


def _map_by_hand(redis_url: str, consumer: str, loc: KVLocation) -> tuple[socket.socket, bytes]:
    """Publish a consumer endpoint and map the producer's pool over its Unix socket, by hand."""
    address = f"raw:{consumer}".encode()
    directory = KVDirectory(redis_url)
    directory.publish_transport_address(consumer, ConnectorKind.SHM, address)
    directory.close()
    sock = connect(loc.transport_address.decode(), 5.0)
    send_msg(sock, ShmHello(consumer=consumer, transport_address=address))
    _, fds = recv_msg(sock, ShmSegment)
    close_fds(fds)
    return sock, address


def _confirm(sock: socket.socket, consumer: str, address: bytes, loc: KVLocation) -> PullReply:
    send_msg(sock, PullRequest(request_id=loc.request_id, transfer_id=1, consumer=consumer, transport_address=address,
                               dst_block_ids=list(loc.block_ids)))
    sock.settimeout(5.0)
    reply, fds = recv_msg(sock, PullReply)
    close_fds(fds)
    return reply


def test_a_consumer_that_vanishes_mid_read_leaves_the_request_pullable(redis_url):
    """Mapping takes nothing from the producer: a consumer that dies before claiming claimed nothing."""
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        _publish(producer, pool, "orphan", [6, 7], 5)
        sock, _ = _map_by_hand(redis_url, "doomed-consumer", _location(redis_url, "orphan"))
        sock.close()  # mapped, maybe read, never confirmed
        _pull_and_check(consumer, cpool, "orphan", [2, 3], 5)
        assert released.get(timeout=5) == ("orphan", [6, 7])


def test_a_read_confirmed_after_the_hold_deadline_is_refused(redis_url):
    deadline_s = 1.0
    with _producer(redis_url, deadline_s=deadline_s) as (producer, pool, released):
        _publish(producer, pool, "slow", [1, 2], 6)
        loc = _location(redis_url, "slow")
        sock, address = _map_by_hand(redis_url, "slow-consumer", loc)
        try:
            assert released.get(timeout=deadline_s + 2) == ("slow", [1, 2]), "blocks released at the hold deadline"
            reply = _confirm(sock, "slow-consumer", address, loc)  # the read may have seen reused blocks
            assert not reply.ok and "released" in reply.reason
        finally:
            sock.close()


def test_a_confirmation_for_another_consumer_is_refused_and_the_request_stays_pullable(redis_url):
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        _publish(producer, pool, "mine", [3], 4)
        loc = _location(redis_url, "mine")
        sock, address = _map_by_hand(redis_url, "liar", loc)
        try:
            reply = _confirm(sock, "liar", b"raw:someone-else", loc)
            assert not reply.ok and "another consumer" in reply.reason
            reply = _confirm(sock, consumer.connector.config.node_id, address, loc)  # its address, another's name
            assert not reply.ok and "not the one it published" in reply.reason
        finally:
            sock.close()
        assert released.empty()
        _pull_and_check(consumer, cpool, "mine", [5], 4)
        assert released.get(timeout=5) == ("mine", [3])


def test_a_claim_holds_the_blocks_until_the_consumer_is_done(redis_url):
    """The claim comes before the read: the producer answers while the consumer copies, and releases the blocks
    only on ShmReadDone; meanwhile nobody else may claim them."""
    with _producer(redis_url) as (producer, pool, released):
        _publish(producer, pool, "claimed", [4, 5], 7)
        loc = _location(redis_url, "claimed")
        sock, address = _map_by_hand(redis_url, "reader", loc)
        other, other_address = _map_by_hand(redis_url, "second-reader", loc)
        try:
            reply = _confirm(sock, "reader", address, loc)
            assert reply.ok and 0 < reply.hold_s <= 5.0
            assert not _confirm(other, "second-reader", other_address, loc).ok  # in flight: nobody else's
            assert released.empty()
            send_msg(sock, ShmReadDone(request_id="claimed", transfer_id=1, ok=True))
            assert released.get(timeout=5) == ("claimed", [4, 5])
        finally:
            sock.close()
            other.close()


def test_a_claimer_whose_connection_ends_releases_the_blocks(redis_url):
    with _producer(redis_url) as (producer, pool, released):
        _publish(producer, pool, "dropped", [2], 3)
        loc = _location(redis_url, "dropped")
        sock, address = _map_by_hand(redis_url, "quitter", loc)
        assert _confirm(sock, "quitter", address, loc).ok
        sock.close()  # claimed, then gone: no one reads the blocks any more
        assert released.get(timeout=5) == ("dropped", [2])


def test_a_read_that_outlasts_its_hold_is_discarded(redis_url, monkeypatch):
    from kvwire.connectors.transports.shm import copier

    slow_copy = copier.BlockCopier.copy

    def copy_past_the_hold(self, dst, src, runs):
        slow_copy(self, dst, src, runs)
        time.sleep(1.3)  # longer than the producer's 1 s hold: its blocks may have been reused meanwhile

    with _producer(redis_url, deadline_s=1.0) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        _publish(producer, pool, "slow-read", [1], 3)
        monkeypatch.setattr(copier.BlockCopier, "copy", copy_past_the_hold)
        mi = ModelInput([SequenceInput("slow-read", [0] * 3, 0, [6])])
        _, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
        assert not bypass  # recomputed, never trusted
        assert released.get(timeout=5) == ("slow-read", [1])


def test_hidden_states_small_ride_inline_and_large_ones_in_a_memfd(redis_url):
    """Up to INLINE_MAX they follow the reply as a raw packet; beyond, a sealed memfd carries them. (Only a prompt's
    last row travels: a row of over 16,384 float32 goes in a memfd.)"""
    from kvwire.connectors.hidden import INLINE_MAX

    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        for rid, width in (("small-hidden", 4096), ("large-hidden", INLINE_MAX // 4 + 1)):
            tokens = 8  # two blocks of 4
            hidden = torch.randn(tokens, width)
            assert (width * 4 <= INLINE_MAX) == (rid == "small-hidden")
            pool.data[[9, 10]] = peer.request_kv(rid, pool.layout, 2)
            mi = ModelInput([SequenceInput(rid, [0] * tokens, 0, [9, 10])])
            producer.connector.send_kv_caches_and_hidden_states(None, mi, producer.kv_caches, hidden)
            got, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(
                None, ModelInput([SequenceInput(rid, [0] * tokens, 0, [1, 2])]), cpool.kv_caches)
            assert bypass and got.shape == hidden.shape and torch.equal(got[-1], hidden[-1])
            assert torch.equal(cpool.data[[1, 2]], peer.request_kv(rid, pool.layout, 2))
            assert released.get(timeout=5)[0] == rid
