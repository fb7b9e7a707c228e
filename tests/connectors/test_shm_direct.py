"""Shared-memory reads with no round trip: the hold board, the direct word's hidden states, the read note."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch
import zmq

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory import KVDirectory
from kvwire.connectors.expected import ExpectedKV
from kvwire.connectors.framing import unpack
from kvwire.connectors.shm import puller as puller_module
from kvwire.connectors.shm.copier import BlockCopier
from kvwire.connectors.shm.hold_board import HoldBoard, map_board, still_held
from kvwire.connectors.wire import KVLocation, KVReady, PullRequest, ShmRead
from kvwire.engine.model_input import ModelInput, SequenceInput
from tests.connectors import peer
from tests.connectors.test_shm import NODE, _consumer, _location, _producer

# --- the board ------------------------------------------------------------------------------


def test_a_board_marks_fresh_tokens_until_full_and_readers_see_the_release():
    board = HoldBoard("board-test", 1, slots=2)
    try:
        fd = os.dup(board.ro_fd)  # what a consumer gets with ShmSegment
        readers_view = map_board(2, fd)
        os.close(fd)  # the mapping stays
        a, b = board.mark(), board.mark()
        assert a is not None and b is not None and a.slot != b.slot and 0 < a.token < b.token
        assert board.mark() is None, "a full board marks nothing: those requests are claimed"
        assert still_held(readers_view, a) and still_held(readers_view, b)
        board.unmark(a)
        assert not still_held(readers_view, a) and still_held(readers_view, b)
        c = board.mark()
        assert c is not None and c.slot == a.slot and c.token > b.token, "a slot is reused, a token never"
        assert not still_held(readers_view, a), "the old token does not come back with its slot"
        assert not still_held(readers_view, msgspec.structs.replace(c, slot=7)), "a slot past the board"
        with pytest.raises(TypeError):
            readers_view[0] = 0  # consumers map it read-only
    finally:
        board.close()


def test_a_later_direct_word_gives_a_settled_record_its_hidden_states_and_nothing_else():
    loc = KVLocation(request_id="r", producer="p", producer_epoch=1, kind=ConnectorKind.SHM, side_channel="s",
                     transport_address=b"a", layout=peer.layout(), block_ids=[1], num_tokens=3, hidden=[])
    record = ExpectedKV("r", "p", time.monotonic() + 5)
    assert record.locate(loc)  # the directory's READY came first
    assert not record.locate(msgspec.structs.replace(loc, inline_hidden=b"x" * 4))
    assert record.location.inline_hidden == b"x" * 4, "the direct word's hidden states are taken"
    assert not record.locate(msgspec.structs.replace(loc, block_ids=[2], inline_hidden=b"y"))
    assert record.location.block_ids == [1], "another location never replaces the settled one"


# --- between a producer and a consumer ------------------------------------------------------


def _work_socket() -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _publish_directly(producer, pool, consumer, rid: str, blocks: list[int], tokens: int, endpoint: str,
                      sock: zmq.Socket) -> KVLocation:
    """Publish `rid` with a direct word to `endpoint`; the consumer expects it and takes the word."""
    consumer.consumer.expect(rid, producer=NODE)
    pool.data[blocks] = peer.request_kv(rid, pool.layout, len(blocks))
    seq = SequenceInput(rid, [0] * tokens, 0, blocks, consumer_endpoint=endpoint)
    producer.connector.send_kv_caches_and_hidden_states(None, ModelInput([seq]), producer.kv_caches,
                                                        peer.request_hidden(rid, tokens, False))
    assert sock.poll(5000), "no KVReady"
    word = unpack(sock.recv(), expect=KVReady).location
    consumer.consumer.located(word)
    return word


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


def test_a_direct_word_is_read_with_no_claim_and_told_after_the_step(redis_url, sent):
    sock, endpoint = _work_socket()
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        try:
            _publish_directly(producer, pool, consumer, "warm-up", [0], 2, endpoint, sock)  # maps the pool
            consumer.connector.recv_kv_caches_and_hidden_states(
                None, ModelInput([SequenceInput("warm-up", [0] * 2, 0, [0])]), cpool.kv_caches)
            consumer.connector.after_step(idle=True)
            assert released.get(timeout=5) == ("warm-up", [0])
            sent.clear()

            word = _publish_directly(producer, pool, consumer, "direct", [6, 7], 6, endpoint, sock)
            assert word.shm_hold is not None and len(word.inline_hidden) == 6 * peer.HIDDEN * 4
            _wait_until(lambda: _location_or_none(redis_url, "direct") is not None)  # READY: a few ms later
            published = _location(redis_url, "direct")
            assert published.shm_hold == word.shm_hold and published.inline_hidden == b"", \
                "the directory gets the hold word, never the hidden states"
            mi = ModelInput([SequenceInput("direct", [0] * 6, 0, [2, 3])])
            hidden, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
            assert bypass and torch.equal(hidden, peer.request_hidden("direct", 6, False))
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


def test_a_hold_word_that_changes_during_the_copy_discards_the_read(redis_url, sent, monkeypatch):
    """The producer releases the request (its hold deadline, say) while the consumer copies: what was copied
    may be torn, so the read is discarded; the claim that follows is refused and the prompt recomputed."""
    sock, endpoint = _work_socket()
    copy = BlockCopier.copy
    with _producer(redis_url) as (producer, pool, released), _consumer(redis_url) as (consumer, cpool):
        held = producer.producer._held  # test-only reach: the producer's held table

        def copy_while_released(self, dst, src, runs):
            held.release("torn")
            copy(self, dst, src, runs)

        try:
            _publish_directly(producer, pool, consumer, "torn", [4], 3, endpoint, sock)
            monkeypatch.setattr(BlockCopier, "copy", copy_while_released)
            mi = ModelInput([SequenceInput("torn", [0] * 3, 0, [9])])
            _, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(None, mi, cpool.kv_caches)
            assert not bypass, "a read the hold word does not vouch for is never used"
            assert PullRequest in sent and ShmRead not in sent, "discarded, then claimed, never noted"
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
