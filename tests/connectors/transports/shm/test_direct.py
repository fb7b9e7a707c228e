"""Shared-memory reads with no round trip: the hold board, the KVReady's hidden states, the read note."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch
import zmq

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.connectors.control.framing import unpack
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.hidden import INLINE_MAX
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.transports.shm import puller as puller_module
from kvwire.connectors.transports.shm.copier import BlockCopier
from kvwire.connectors.transports.shm.hold_board import PAGE, BoardView, HoldBoard, map_board
from kvwire.connectors.wire import KVLocation, KVReady, PullRequest, ShmRead
from tests.connectors import peer
from tests.connectors.transports.shm.test_shm import NODE, _consumer, _location, _producer

# --- the board ------------------------------------------------------------------------------


def _readers_view(board: HoldBoard):
    fd = os.dup(board.ro_fd)  # what a consumer gets with ShmSegment
    try:
        return map_board(board.slots, board.hidden_bytes, fd)
    finally:
        os.close(fd)  # the mapping stays


def test_a_board_marks_fresh_tokens_until_full_and_readers_see_the_release():
    board = HoldBoard("board-test", 1, slots=2)
    try:
        view = _readers_view(board)
        a, b = board.mark(), board.mark()
        assert a is not None and b is not None and a.slot != b.slot and 0 < a.token < b.token
        assert a.hidden_at == -1, "no hidden states: nothing in the area"
        assert board.mark() is None, "a full board marks nothing: those requests are claimed"
        assert view.still_held(a) and view.still_held(b)
        board.unmark(a)
        assert not view.still_held(a) and view.still_held(b)
        c = board.mark()
        assert c is not None and c.slot == a.slot and c.token > b.token, "a slot is reused, a token never"
        assert not view.still_held(a), "the old token does not come back with its slot"
        assert not view.still_held(msgspec.structs.replace(c, slot=7)), "a slot past the board"
        with pytest.raises(TypeError):
            view.words[0] = 0  # consumers map it read-only
    finally:
        board.close()


def test_the_boards_hidden_area_holds_hidden_states_until_unmarked_and_reuses_freed_pages():
    board = HoldBoard("board-area", 1, slots=4, hidden_bytes=4 * PAGE)
    try:
        view = _readers_view(board)
        big, small = torch.randn(3 * PAGE // 4), torch.arange(10, dtype=torch.int32)  # 3 pages, then 1
        a, b = board.mark([big]), board.mark([small, small])
        assert (a.hidden_at, b.hidden_at) == (0, 3 * PAGE)
        out = [torch.empty_like(small), torch.empty_like(small)]
        assert view.has_hidden(b, 80) and view.read_hidden(b, out) == 80
        assert all(torch.equal(o, small) for o in out)
        got = torch.empty_like(big)
        view.read_hidden(a, got)
        assert torch.equal(got, big)
        assert board.mark([small]).hidden_at == -1, "no room in the area: the hold has no hidden states"
        board.unmark(b)
        board.unmark(a)
        whole = board.mark([torch.zeros(PAGE)])  # 4 pages: the freed runs merged again
        assert whole.hidden_at == 0 and view.still_held(whole)
        assert not view.has_hidden(msgspec.structs.replace(whole, hidden_at=4 * PAGE), 1), "past the area"
    finally:
        board.close()


def test_a_later_kv_ready_gives_a_settled_record_its_hidden_states_and_nothing_else():
    loc = KVLocation(request_id="r", producer="p", producer_epoch=1, kind=ConnectorKind.SHM, side_channel="s",
                     transport_address=b"a", layout=peer.layout(), block_ids=[1], num_tokens=3, hidden=[])
    record = ExpectedKV("r", "p", time.monotonic() + 5)
    assert record.locate(loc)  # the directory's READY came first
    assert not record.locate(msgspec.structs.replace(loc, inline_hidden=b"x" * 4))
    assert record.location.inline_hidden == b"x" * 4, "the KVReady's hidden states are taken"
    assert not record.locate(msgspec.structs.replace(loc, block_ids=[2], inline_hidden=b"y"))
    assert record.location.block_ids == [1], "another location never replaces the settled one"


# --- between a producer and a consumer ------------------------------------------------------


def _work_socket() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _wide_hidden(rid: str, tokens: int) -> torch.Tensor:
    """Hidden states whose last row (all that travels of them) is too big for the KVReady: `[tokens, width]`."""
    width = INLINE_MAX // 4 + 1
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(len(rid)))


def _publish_directly(producer, pool, consumer, rid: str, blocks: list[int], tokens: int, endpoint: str,
                      sock: zmq.Socket, hidden: torch.Tensor | None = None) -> KVLocation:
    """Publish `rid` with a KVReady to `endpoint`; the consumer expects it and takes it."""
    consumer.consumer.expect(rid, producer=NODE)
    pool.data[blocks] = peer.request_kv(rid, pool.layout, len(blocks))
    seq = SequenceInput(rid, [0] * tokens, 0, blocks, consumer_endpoint=endpoint)
    hidden = peer.request_hidden(rid, tokens, False) if hidden is None else hidden
    producer.connector.send_kv_caches_and_hidden_states(None, ModelInput([seq]), producer.kv_caches, hidden)
    assert sock.poll(5000), "no KVReady"
    told = unpack(sock.recv(), expect=KVReady).location
    consumer.consumer.take_kv_ready(told)
    return told


@pytest.fixture
def sent(monkeypatch) -> list[type]:
    """The types of the messages the consumer's puller sends its producers."""
    types: list[type] = []
    send = puller_module.send_msg

    def spy(sock, msg, fds=()):
        types.append(type(msg))
        return send(sock, msg, fds)

    monkeypatch.setattr(puller_module, "send_msg", spy)
    return types


def _map_pool(producer, pool, consumer, cpool, released, sent: list[type], endpoint: str, sock: zmq.Socket) -> None:
    """One request read, so the consumer has the producer's pool and board mapped; `sent` cleared after."""
    _publish_directly(producer, pool, consumer, "warm-up", [0], 2, endpoint, sock)
    consumer.connector.recv_kv_caches_and_hidden_states(
        None, ModelInput([SequenceInput("warm-up", [0] * 2, 0, [0])]), cpool.kv_caches)
    consumer.connector.after_step(idle=True)
    assert released.get(timeout=5) == ("warm-up", [0])
    sent.clear()


def test_a_kv_ready_is_read_with_no_claim_and_told_after_the_step(redis_url, sent):
    sock, endpoint = _work_socket()
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        try:
            _map_pool(producer, pool, consumer, cpool, released, sent, endpoint, sock)

            told = _publish_directly(producer, pool, consumer, "direct", [6, 7], 6, endpoint, sock)
            assert told.shm_hold is not None and len(told.inline_hidden) == peer.HIDDEN * 4  # the prompt's last row
            _wait_until(lambda: _location_or_none(redis_url, "direct") is not None)  # READY: a few ms later
            published = _location(redis_url, "direct")
            assert published.shm_hold == told.shm_hold and published.inline_hidden == b"", \
                "the directory gets the hold word, never the hidden states"
            mi = ModelInput([SequenceInput("direct", [0] * 6, 0, [2, 3])])
            hidden, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
            assert bypass and peer.received_as_sent(hidden, "direct", 6)
            assert torch.equal(cpool.data[[2, 3]], peer.request_kv("direct", pool.layout, 2))
            assert sent == [], "no claim, and the note waits for the step's end"
            consumer.connector.after_step()
            assert sent == [], "a busy node's step sends only notes NOTE_AGE_S old: the first token goes first"
            assert released.empty(), "the producer holds the blocks until it is told"
            consumer.connector.after_step(idle=True)
            assert sent == [ShmRead]
            assert released.get(timeout=5) == ("direct", [6, 7])
            _wait_until(lambda: _location_or_none(redis_url, "direct") is None)  # CONSUMED, then deleted
        finally:
            sock.close(0)


@pytest.mark.parametrize("told_directly", [True, False], ids=["kv-ready", "directory-only"])
def test_hidden_states_too_big_for_the_kv_ready_are_read_from_the_board_with_no_claim(redis_url, sent, told_directly,
                                                                                monkeypatch):
    """Hidden states whose last row passes INLINE_MAX lie in the board's hidden area, so the read still needs no
    round trip, whether the consumer was told directly (it reads them ahead, as the KVReady
    comes) or found the location itself (the pull reads them)."""
    sock, endpoint = _work_socket()
    hidden = _wide_hidden("wide", 6)
    in_pull = []
    read_hidden = BoardView.read_hidden
    monkeypatch.setattr(BoardView, "read_hidden", lambda self, *a: in_pull.append(1) or read_hidden(self, *a))
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        try:
            _map_pool(producer, pool, consumer, cpool, released, sent, endpoint, sock)
            if told_directly:
                told = _publish_directly(producer, pool, consumer, "wide", [6, 7], 6, endpoint, sock, hidden)
                assert told.inline_hidden == b"" and told.shm_hold.hidden_at >= 0
            else:
                consumer.consumer.expect("wide", producer=NODE)
                pool.data[[6, 7]] = peer.request_kv("wide", pool.layout, 2)
                producer.connector.send_kv_caches_and_hidden_states(
                    None, ModelInput([SequenceInput("wide", [0] * 6, 0, [6, 7])]), producer.kv_caches, hidden)
            mi = ModelInput([SequenceInput("wide", [0] * 6, 0, [2, 3])])
            got, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
            assert bypass and got.shape == hidden.shape and torch.equal(got[-1], hidden[-1])
            assert torch.equal(cpool.data[[2, 3]], peer.request_kv("wide", pool.layout, 2))
            assert len(in_pull) == (0 if told_directly else 1), "read ahead when told directly, else in the pull"
            consumer.connector.after_step(idle=True)
            assert sent == [ShmRead], "no claim: the read's only message is its note"
            assert released.get(timeout=5) == ("wide", [6, 7])
        finally:
            sock.close(0)


def test_hidden_states_read_ahead_and_then_reused_are_never_used(redis_url, sent):
    """Read ahead as the KVReady came, then the request released and its pages given to another request: the
    pull's check finds the hold word changed, so neither those bytes nor the blocks are used (recomputed)."""
    sock, endpoint = _work_socket()
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        try:
            _map_pool(producer, pool, consumer, cpool, released, sent, endpoint, sock)
            first = _publish_directly(producer, pool, consumer, "stale", [5], 3, endpoint, sock,
                                      _wide_hidden("stale", 3))
            producer.producer._held.release("stale")  # test-only reach: its hold deadline, say
            assert released.get(timeout=5) == ("stale", [5])
            second = _publish_directly(producer, pool, consumer, "reuser", [5], 3, endpoint, sock,
                                       _wide_hidden("reuser-longer", 3))
            assert second.shm_hold.hidden_at == first.shm_hold.hidden_at, "the freed pages went to the next"
            mi = ModelInput([SequenceInput("stale", [0] * 3, 0, [9])])
            _, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
            assert not bypass, "a read the hold word does not vouch for is never used"
            assert PullRequest in sent and ShmRead not in sent
        finally:
            sock.close(0)


@pytest.mark.parametrize("wide", [False, True], ids=["hidden-in-kv-ready", "hidden-in-board"])
def test_a_hold_word_that_changes_during_the_copy_discards_the_read(redis_url, sent, monkeypatch, wide):
    """The producer releases the request (its hold deadline, say) while the consumer copies: what was copied
    may be torn, so the read is discarded; the claim that follows is refused and the prompt recomputed."""
    sock, endpoint = _work_socket()
    copy = BlockCopier.copy
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        held = producer.producer._held  # test-only reach: the producer's held table

        copies = []

        def copy_while_released(self, dst, src, runs):
            held.release("torn")
            copies.append(runs)
            copy(self, dst, src, runs)

        try:
            _publish_directly(producer, pool, consumer, "torn", [4], 3, endpoint, sock,
                              _wide_hidden("torn", 3) if wide else None)
            monkeypatch.setattr(BlockCopier, "copy", copy_while_released)
            mi = ModelInput([SequenceInput("torn", [0] * 3, 0, [9])])
            _, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
            assert not bypass, "a read the hold word does not vouch for is never used"
            assert PullRequest in sent and ShmRead not in sent, "discarded, then claimed, never noted"
            assert len(copies) == 2, "read with no claim first, then after the claim"
            assert released.get(timeout=5) == ("torn", [4])
        finally:
            sock.close(0)


def _location_or_none(redis_url: str, rid: str):
    directory = KVDirectory(redis_url)
    try:
        return directory.get(rid)
    finally:
        directory.close()


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_read_with_no_claim_stands_when_its_producer_dies_during_it(redis_url, monkeypatch):
    """A dead producer's memory lives on while mapped and nobody can reuse its blocks any more: the read is
    whole, and its note, with nobody to go to, is dropped."""
    from tests.connectors.test_conformance import _consumer as conformance_consumer
    from tests.connectors.test_conformance import _producer as conformance_producer

    lay = peer.layout()
    proc, _ = conformance_producer(ConnectorKind.SHM, redis_url, lay, [("orphan", 6, [3, 4])])
    side, pool = conformance_consumer(ConnectorKind.SHM, redis_url, lay)
    copy = BlockCopier.copy

    def copy_after_the_producer_died(self, dst, src, runs):
        proc.kill()
        proc.join(10)
        copy(self, dst, src, runs)

    monkeypatch.setattr(BlockCopier, "copy", copy_after_the_producer_died)
    try:
        mi = ModelInput([SequenceInput("orphan", [0] * 6, 0, [9, 1])])
        hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        assert proc.exitcode == -9, "the producer died before the copy"
        assert bypass and peer.received_as_sent(hidden, "orphan", 6)
        assert torch.equal(pool.data[[9, 1]], peer.request_kv("orphan", lay, 2))
        side.connector.after_step(idle=True)  # the note finds the producer's socket gone: dropped, no error
    finally:
        side.close()
        proc.kill()
