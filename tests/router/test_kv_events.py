"""vLLM's KV events: decoded as vLLM encodes them, applied to the prefix index, followed over a real ZMQ socket."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvwire.connectors.config import NodeRole
from kvwire.router.config import RoutingPolicy
from kvwire.router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, SeqOrder, decode_batch, follow
from kvwire.router.vllm.load import ServerLoad
from kvwire.router.vllm.pool import InstancePool
from kvwire.router.vllm.schedule import Scheduler

D1, D2 = "http://d1:1", "http://d2:1"
BLOCK = 4


# vLLM's own structs (vllm/distributed/kv_events.py), every field, as its publisher encodes them
class VBlockStored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class VBlockRemoved(msgspec.Struct, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VAllBlocksCleared(msgspec.Struct, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


def payload(*events) -> bytes:
    return msgspec.msgpack.encode(VBatch(1.0, list(events), 0))


def test_a_batch_decodes_as_vllm_encodes_it():
    batch = decode_batch(payload(VBlockStored([b"h1", 7], None, list(range(8)), BLOCK, None, "GPU", None),
                                 VBlockRemoved([7], "GPU"), VAllBlocksCleared()))
    assert batch.events == [BlockStored([b"h1", 7], None, list(range(8)), BLOCK), BlockRemoved([7]),
                            AllBlocksCleared()]
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\x93\x01")  # not a batch: refused, never executed
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Pickle", "data": b"x"}]]))


def scheduler() -> Scheduler:
    prefill, decode = InstancePool(NodeRole.PREFILL, []), InstancePool(NodeRole.DECODE, [D1, D2])
    decode.measured(D1, ServerLoad(0, 0.0, BLOCK))
    return Scheduler(RoutingPolicy.PREFIX, 0, 120.0, prefill, decode)


def test_an_instance_s_events_make_its_entries_exact_and_its_predictions_stop():
    s = scheduler()
    prompt = list(range(12))
    s.sent(NodeRole.DECODE, D1, prompt)  # predicted: 3 blocks
    s.sent(NodeRole.DECODE, D2, prompt)
    assert (p := s.place(prompt)) is not None and p.held == 12
    s.kv_events(D1, [BlockStored([11], None, prompt[:4], BLOCK)])  # exact from here: it holds 1 block
    s.sent(NodeRole.DECODE, D1, prompt)  # no longer predicted
    held = {url: (s.place(prompt, avoid=frozenset({other})) or p).held for url, other in ((D1, D2), (D2, D1))}
    assert held == {D1: 4, D2: 12}
    s.kv_events(D1, [BlockStored([12, 13], 11, prompt[4:12], BLOCK)])  # chained on block 11
    assert (s.place(prompt, avoid=frozenset({D2})) or p).held == 12
    s.kv_events(D1, [BlockRemoved([12])])  # its second block evicted: the third is no use without it
    assert (s.place(prompt, avoid=frozenset({D2})) or p).held == 4
    s.kv_events(D1, [BlockStored([99], 1234, prompt[4:8], BLOCK)])  # after a block it never told of: skipped
    assert (s.place(prompt, avoid=frozenset({D2})) or p).held == 4
    s.kv_events(D1, [AllBlocksCleared()])
    assert (s.place(prompt, avoid=frozenset({D2})) or p).held == 0


def test_events_of_other_groups_or_block_sizes_are_not_used():
    s = scheduler()
    prompt = list(range(8))
    s.kv_events(D1, [BlockStored([1, 2], None, prompt, BLOCK, group_idx=1),
                     BlockStored([3], None, list(range(16)), 16)])
    assert (p := s.place(prompt, avoid=frozenset({D2}))) is not None and p.held == 0


def test_a_gap_in_sequence_numbers_is_seen():
    order = SeqOrder()
    assert order.follows(5) and order.follows(6)
    assert not order.follows(8)
    assert not order.follows(0)  # a restarted publisher counts from 0 again
    assert order.follows(1)


def test_follow_applies_what_a_publisher_sends_and_clears_on_a_gap():
    async def run() -> list[list[KVEvent]]:
        ctx = zmq.asyncio.Context.instance()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        got: list[list[KVEvent]] = []
        arrived = asyncio.Event()

        def apply(url: str, events: Sequence[KVEvent]) -> None:
            assert url == D1
            got.append(list(events))
            arrived.set()

        task = asyncio.create_task(follow(f"tcp://127.0.0.1:{port}", D1, apply))
        stored = VBlockStored([1], None, [1, 2, 3, 4], BLOCK, None, "GPU", None)
        seq = 0
        while not arrived.is_set():  # a SUB socket misses what is sent before it joined: send until one arrives
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload(stored)])
            seq += 1
            await asyncio.sleep(0.02)
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"not msgpack"])  # a restart: gap, then junk
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), payload(VBlockRemoved([1], "GPU"))])
        for _ in range(250):
            if got[-1] == [BlockRemoved([1])]:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        pub.close(0)
        return got

    got = asyncio.run(run())
    assert got[-2:] == [[AllBlocksCleared()], [BlockRemoved([1])]]
    assert all(events == [BlockStored([1], None, [1, 2, 3, 4], BLOCK)] for events in got[:-2]) and got[:-2]
