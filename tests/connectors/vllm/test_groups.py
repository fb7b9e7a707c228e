"""vLLM's KV cache groups (connectors/vllm/groups.py): which blocks move, and one pull moving them.

A Gemma-3-like hybrid: group 0 a sliding window of 8 tokens, group 1 full attention, blocks of 4
tokens, both groups' layers viewing the same two tensors (vLLM's hybrid allocator). The producer is
a process of its own holding `Groups.held`'s list; the consumer pulls `Groups.pull`'s pick and must
hold exactly those blocks' bytes, nothing written elsewhere (prefix-cached or null blocks).
"""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.vllm.groups import Groups
from kvwire.connectors.vllm.layout import region_of
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
BLOCKS, BLOCK, HEADS, HEAD_DIM = 32, 4, 2, 8
GROUPS = Groups(windows=(8, 0), block_size=BLOCK, layers=(("sw.0", "sw.1"), ("full.0", "full.1")))
TOKENS = 18  # 5 blocks; the window's 8 tokens (and one more) lie in blocks 2..4
PREFILL = ([0, 0, 3, 4, 5], [6, 7, 8, 9, 10])  # the prefill server freed the sliding group's blocks 0, 1
DECODE = ([0, 0, 0, 20, 21], [22, 23, 24, 25, 26])  # the decode server allocated from block 3 on


def planes() -> list[torch.Tensor]:
    """The two tensors both groups' layers view: [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    return [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(2)]


def caches(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensors[i] for names in GROUPS.layers for i, name in enumerate(names)}


def test_a_sliding_group_moves_its_window_and_a_full_group_everything():
    assert [GROUPS.first_needed(g, TOKENS) for g in (0, 1)] == [2, 0]
    assert GROUPS.held(PREFILL, TOKENS) == [3, 4, 5, 6, 7, 8, 9, 10]
    blocks, pick = GROUPS.pull(DECODE, TOKENS, first_block=0)
    assert blocks == [0, 20, 21, 22, 23, 24, 25, 26] and pick == [1, 2, 3, 4, 5, 6, 7], "no write to a null block"
    blocks, pick = GROUPS.pull(DECODE, TOKENS, first_block=4)  # blocks 0..3 in the prefix cache
    assert [blocks[i] for i in pick] == [21, 26]
    assert GROUPS.first_needed(0, 5) == 0, "a prompt shorter than the window needs all of it"


def test_one_group_of_full_attention_moves_what_it_always_moved():
    one = Groups(windows=(0,), block_size=16, layers=(("l0", "l1"),))
    assert one.held(([4, 5, 6, 7],), 40) == [4, 5, 6]
    assert one.pull(([1, 2, 3, 9],), 40, first_block=1) == ([1, 2, 3], [1, 2])


def test_a_window_the_prefill_decoded_past_is_refused():
    with pytest.raises(ValueError, match="max_tokens 1"):
        GROUPS.held(([0, 0, 0, 4, 5], PREFILL[1]), TOKENS)


def test_groups_must_share_their_tensors():
    tensors = planes()
    assert list(GROUPS.planes(caches(tensors))) == ["sw.0", "sw.1"]
    apart = {**caches(tensors), "full.1": torch.zeros_like(tensors[1])}
    with pytest.raises(ValueError, match="share their tensors"):
        GROUPS.planes(apart)


def fill(t: torch.Tensor, block: int, layer: int) -> None:
    t[block] = float(1000 * layer + block)


def producer(redis_url: str, kind: ConnectorKind, results) -> None:
    """The prefill side's process: hold `PREFILL`'s moved blocks (block b of layer l holds 1000 l + b); report
    when the consumer's pull released them."""
    tensors = planes()
    for layer, t in enumerate(tensors):
        for block in range(1, BLOCKS):
            fill(t, block, layer)
    config = ConnectorConfig(kind=kind, role=NodeRole.PREFILL, node_id="prefill", redis_url=redis_url,
                             kv_deadline_s=60.0)
    directory = KVDirectory(redis_url)
    epoch = directory.next_epoch(config.node_id)
    prod = KVProducer(config, directory, epoch, create_transport(config, epoch),
                      region_of(GROUPS.planes(caches(tensors)), BLOCKS, BLOCK))
    prod.hold("r", GROUPS.held(PREFILL, TOKENS), TOKENS)
    results.put("held")
    results.put(("released", list(peer.wait_released(prod, 1, 30))))
    prod.close()
    directory.close()
    peer.flush_replies()


@pytest.mark.parametrize("kind", [ConnectorKind.UCX, ConnectorKind.TCP], ids=["ucx", "tcp"])
def test_one_pull_moves_each_groups_blocks_and_nothing_else(kind, redis_url):
    results = CTX.Queue()
    proc = CTX.Process(target=producer, args=(redis_url, kind, results))
    proc.start()
    try:
        assert results.get(timeout=60) == "held"
        tensors = planes()
        config = ConnectorConfig(kind=kind, role=NodeRole.DECODE, node_id="decode", redis_url=redis_url,
                                 kv_deadline_s=30.0)
        directory = KVDirectory(redis_url)
        consumer = KVConsumer(config, directory, create_transport(config, directory.next_epoch("decode")),
                              region_of(GROUPS.planes(caches(tensors)), BLOCKS, BLOCK))
        blocks, pick = GROUPS.pull(DECODE, TOKENS, first_block=1)  # block 0 prefix-cached
        try:
            consumer.expect("r", "prefill")
            got = consumer.receive_blocks("r", TOKENS, blocks, pick=pick)
        finally:
            consumer.close()
            directory.close()
        assert results.get(timeout=30) == ("released", ["r"])
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    held = GROUPS.held(PREFILL, TOKENS)
    want = {blocks[i]: held[i] for i in pick}  # our block -> the producer's it holds now
    assert sorted(want) == [20, 21, 23, 24, 25, 26]
    for layer, t in enumerate(tensors):
        for block in range(BLOCKS):
            expect = float(1000 * layer + want[block]) if block in want else 0.0
            assert bool((t[block] == expect).all()), f"layer {layer} block {block}"
    assert got.kv_bytes == len(pick) * 2 * t[0].numel() * t.element_size()
