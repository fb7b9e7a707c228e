"""Small pieces packed into UCX messages (connectors/transports/ucx/packing.py, flows.py)."""

from __future__ import annotations

import time

import pytest
import torch

from kvwire.connectors.transports.ucx.flows import SendFlow
from kvwire.connectors.transports.ucx.lanes import ReceiveLanes
from kvwire.connectors.transports.ucx.packing import PACK_BYTES, Message, Staging, gather, plan_messages, scatter
from kvwire.connectors.transports.ucx.worker import Role, UCXWorker

KIB = 1 << 10


def test_small_pieces_are_packed_and_large_ones_go_alone_in_order():
    sizes = [10 * KIB, 20 * KIB, 300 * KIB, 5 * KIB, 300 * KIB, 1 * KIB]
    assert plan_messages(sizes, 256 * KIB) == [
        Message(0, 2, 30 * KIB, True), Message(2, 1, 300 * KIB, False), Message(3, 1, 5 * KIB, True),
        Message(4, 1, 300 * KIB, False), Message(5, 1, 1 * KIB, True)]


def test_packs_never_exceed_a_slot_and_cover_every_piece_once():
    sizes = [100 * KIB + i for i in range(40)]
    plan = plan_messages(sizes, 256 * KIB)
    assert all(m.packed and m.nbytes <= PACK_BYTES for m in plan)
    assert len(plan) > 1
    assert [i for m in plan for i in range(m.first, m.first + m.count)] == list(range(len(sizes)))
    assert [m.nbytes for m in plan] == [sum(sizes[m.first:m.first + m.count]) for m in plan]


def test_no_pack_spans_a_layer_boundary():
    """A layer-wise stream: 3 pieces a layer, 2 layers, then a hidden-state piece; each layer's last pack can go
    as soon as that layer is written."""
    plan = plan_messages([KIB] * 7, 256 * KIB, boundary=3)
    assert [(m.first, m.count) for m in plan] == [(0, 3), (3, 3), (6, 1)]
    assert all(m.packed for m in plan)


def test_without_a_threshold_every_piece_is_its_own_message():
    assert plan_messages([1, 2, 3], 0) == [Message(i, 1, s, False) for i, s in enumerate([1, 2, 3])]


@pytest.mark.parametrize("bad", [-1, PACK_BYTES + 1, 2**40])
def test_a_threshold_a_slot_cannot_hold_is_refused(bad):
    with pytest.raises(ValueError, match="pack_below"):
        plan_messages([1], bad)


def test_staging_hands_out_at_most_its_slots_and_reuses_them():
    staging = Staging(2)
    a, b = staging.take(), staging.take()
    assert a is not None and b is not None and staging.take() is None
    staging.give(a)
    assert staging.take() is a
    staging.discard(b)  # a slot a failed transfer may still touch is replaced, never handed out again
    c = staging.take()
    assert c is not None and c is not b and staging.take() is None


def test_gather_then_scatter_moves_every_byte():
    src = [memoryview(bytearray(torch.randint(0, 255, (n,), dtype=torch.uint8).numpy().tobytes())) for n in (3, 700, 1)]
    dst = [memoryview(bytearray(p.nbytes)) for p in src]
    msg = Message(0, 3, 704, True)
    slot = memoryview(bytearray(PACK_BYTES))
    assert gather(src, msg, slot).nbytes == 704
    scatter(slot, dst, msg)
    assert [bytes(d) for d in dst] == [bytes(s) for s in src]


def _run(lanes: ReceiveLanes, producer: UCXWorker, sends: SendFlow, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not (lanes.done() and sends.done()):
        if time.monotonic() > deadline:
            return False
        lanes.progress()
        producer.progress()
        sends.advance()
    return True


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_transfer_of_large_and_small_pieces_lands_byte_exact(lanes):
    """Pieces on both sides of the threshold, more packs than either side has slots, over real UCX."""
    sizes = [300 * KIB, *[40 * KIB] * 60, 500 * KIB, 7, 260 * KIB, *[100 * KIB] * 20]
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    producer, consumer = UCXWorker(Role.PRODUCER), ReceiveLanes(lanes)
    try:
        consumer.post(producer.address, [memoryview(t.numpy()) for t in dst], 5, 256 * KIB)
        staging = Staging(2)
        sends = SendFlow(producer, consumer.address, [memoryview(t.numpy()) for t in src], 5, 256 * KIB, staging)
        assert _run(consumer, producer, sends), "transfer did not complete"
        consumer.check_errors()
        sends.check_errors()
        assert all(torch.equal(s, d) for s, d in zip(src, dst))
        assert staging.take() is not None and staging.take() is not None  # every slot came back
    finally:
        consumer.close()
        producer.close()


def test_per_piece_sends_never_land_in_packed_receives():
    """A producer that ignores the consumer's packing (an older build) sends one message per piece: the
    packed receives must not take them (a smaller message fits a larger buffer, and would land in the
    wrong place); the pull stalls and is cancelled, and nothing was written."""
    dst = [torch.zeros(1000, dtype=torch.uint8) for _ in range(4)]
    producer, consumer = UCXWorker(Role.PRODUCER), ReceiveLanes(1)
    try:
        consumer.post(producer.address, [memoryview(t.numpy()) for t in dst], 9, 4096)
        src = [torch.full((1000,), 7, dtype=torch.uint8) for _ in range(4)]
        sends = SendFlow(producer, consumer.address, [memoryview(t.numpy()) for t in src], 9, 0, Staging(1))
        assert not _run(consumer, producer, sends, timeout_s=0.5)
        assert consumer.stop(producer.address) == 1  # the one packed receive
        assert all(not t.any() for t in dst)
    finally:
        consumer.close()
        producer.close()


def test_a_producer_refuses_a_threshold_out_of_range_before_sending_anything():
    producer, consumer = UCXWorker(Role.PRODUCER), ReceiveLanes(1)
    try:
        with pytest.raises(ValueError, match="pack_below"):
            SendFlow(producer, consumer.address, [memoryview(bytearray(8))], 1, PACK_BYTES + 1, Staging(1))
    finally:
        consumer.close()
        producer.close()


def test_a_consumer_that_stops_reading_holds_only_its_share_of_the_producers_slots():
    """The producer's slots serve every pull: one pull whose consumer never posts its receives (hung, but alive)
    holds at most PULL_SLOTS of them until its deadline, and the next pull still finds slots."""
    from kvwire.connectors.transports.ucx.flows import PULL_SLOTS

    producer, stuck = UCXWorker(Role.PRODUCER), ReceiveLanes(1)
    staging = Staging(2 * PULL_SLOTS)
    try:
        parts = [memoryview(bytearray(200 * KIB)) for _ in range(100)]  # 20 packs of 1 MiB at most
        sends = SendFlow(producer, stuck.address, parts, 3, 256 * KIB, staging)
        for _ in range(50):
            producer.progress()
            sends.advance()
        assert not sends.done()
        assert [staging.take() for _ in range(PULL_SLOTS)].count(None) == 0 and staging.take() is None
        sends.discard_slots()
    finally:
        stuck.close()
        producer.close()


def test_sub_blocks_travel_packed_only_when_the_consumer_asks_and_the_pool_packs():
    """A host pool's sub-blocks go as one packed buffer when the pull request says `packed` (a consumer that lands
    them so); an older consumer's request does not, and gets the pieces; a pool that cannot pack refuses."""
    from types import SimpleNamespace

    from kvwire.connectors.transports.ucx.send_engine import _parts
    from tests.connectors.transports.test_sub_blocks import CPU, pool, write_prompt

    caches, region = pool(8, 4, CPU)
    write_prompt(caches, [1], 8, 8, CPU)
    split = region.sub_blocks(4)
    hidden = [torch.ones(3)]

    def job(packed: bool, on=split):
        return SimpleNamespace(region=on, runs=[(2, 2)], held=SimpleNamespace(gate=None, hidden=hidden),
                               msg=SimpleNamespace(packed=packed),
                               parts=lambda: on.parts([(2, 2)]), stream_parts=lambda: [b"packed"])

    pieces = _parts(job(False))
    assert len(pieces) == split.num_parts([(2, 2)]) > 2
    assert _parts(job(True)) == [b"packed"]
    with pytest.raises(ValueError, match="do not pack"):
        _parts(job(True, on=region))  # whole blocks: nothing to pack
