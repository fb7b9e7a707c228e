"""Pulls between pools of different block sizes, between real processes: a prefill process holds a prompt in vLLM's
CPU layout (`[num_blocks, heads, block_size, 2 * head_dim]` per layer, a head's page its K transposed, then its V,
as the CPU backend reads it) in blocks of one size, the consumer here
keeps blocks of another; every transport moves it in blocks of the smaller size and every token's K and V lands
where the consumer keeps it: the whole prompt, a tail after blocks the consumer holds, and a pick."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.vllm.identity import rank_node_id
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.vllm.tp import TPSplit, plan, rank_key
from tests import procs
from tests.connectors import peer
from tests.connectors.vllm_pages import put, read_kv

CTX = procs.CTX
LAYERS, HEADS, HEAD_DIM, BLOCKS, TOKENS = 2, 2, 4, 36, 37  # 2 heads: TP=2 gives a rank one
HOLD_S = 30.0


def token_kv(rid: str, layer: int, head: int, token: int) -> torch.Tensor:
    """A token's K (row 0) and V (row 1) in one head of one layer: [2, head_dim], told apart by all four."""
    return (torch.full((2 * HEAD_DIM,), float(zlib.crc32(f"{rid}/{layer}/{head}/{token}".encode()) % 10_000))
            + torch.arange(2 * HEAD_DIM)).view(2, HEAD_DIM)


def _tensors(block_size: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(BLOCKS, HEADS, block_size, 2 * HEAD_DIM, device=device) for i in range(LAYERS)}


def _config(kind: ConnectorKind, role: NodeRole, node_id: str, redis_url: str) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=node_id, redis_url=redis_url, kv_deadline_s=HOLD_S)


def _blocks(n: int, block_size: int, turn: int) -> list[int]:
    """Request `n`'s blocks: scattered over its own 12, rotated by `turn`."""
    return [12 * n + (turn + 5 * i) % 12 for i in range(-(-TOKENS // block_size))]


def prefill(redis_url: str, kind: ConnectorKind, block_size: int, rids: list[str], results,
            device: str = "cpu") -> None:
    """The prefill process: hold each prompt in its blocks of `block_size`; report when all are released."""
    tensors = _tensors(block_size, device)
    config = _config(kind, NodeRole.PREFILL, f"p-sub-{kind}", redis_url)
    directory = KVDirectory(redis_url)
    epoch = directory.next_epoch(config.node_id)
    producer = KVProducer(config, directory, epoch, create_transport(config, epoch),
                          region_of(tensors, BLOCKS, block_size))
    for n, rid in enumerate(rids):
        blocks = _blocks(n, block_size, 0)
        for layer, t in enumerate(tensors.values()):
            for tok in range(TOKENS):
                for h in range(HEADS):
                    put(t, blocks[tok // block_size], h, tok % block_size, token_kv(rid, layer, h, tok).to(device))
        producer.hold(rid, blocks, TOKENS)
    results.put("held")
    results.put(len(peer.wait_released(producer, len(rids), HOLD_S / 2)) == len(rids))
    producer.close()
    directory.close()
    peer.flush_replies()


def holds(tensors: dict[str, torch.Tensor], rid: str, blocks: list[int], block_size: int, first: int = 0) -> bool:
    """Whether tokens `[first, TOKENS)` of `rid` are in `blocks` (the prompt's block list) as the producer's."""
    return all(torch.equal(read_kv(t, blocks[tok // block_size], h, tok % block_size).cpu(),
                           token_kv(rid, layer, h, tok))
               for layer, t in enumerate(tensors.values()) for tok in range(first, TOKENS) for h in range(HEADS))


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")]
CASES = [pytest.param(kind, theirs, ours, "cpu", id=f"{kind}-{theirs}-{ours}")
         for kind in (ConnectorKind.TCP, ConnectorKind.UCX, ConnectorKind.SHM, ConnectorKind.AUTO)
         for theirs, ours in ((8, 4), (4, 8))]
# vLLM's GPU pools (kvwire's own layout model of them: these tensors on cuda:0, both processes on it): auto reads
# blocks of another size over UCX (CUDA IPC copies whole rows only), counted as a fallback
GPU_CASES = [pytest.param(kind, 8, 4, "cuda", id=f"cuda-{kind}", marks=ON_GPU)
             for kind in (ConnectorKind.UCX, ConnectorKind.AUTO, ConnectorKind.TCP)]


@pytest.mark.parametrize(("kind", "theirs", "ours", "device"), CASES + GPU_CASES)
def test_a_prompt_moves_between_block_sizes_token_by_token(kind, theirs, ours, device, redis_url):
    rids = [f"whole-{kind}-{theirs}", f"tail-{kind}-{theirs}", f"pick-{kind}-{theirs}"]
    results = CTX.Queue()
    proc = CTX.Process(target=prefill, args=(redis_url, kind, theirs, rids, results, device))
    proc.start()
    tensors = _tensors(ours, device)
    config = _config(kind, NodeRole.DECODE, f"c-sub-{kind}", redis_url)
    directory = KVDirectory(redis_url)
    consumer = KVConsumer(config, directory, create_transport(config, directory.next_epoch(config.node_id)),
                          region_of(tensors, BLOCKS, ours))
    try:
        assert results.get(timeout=60) == "held"
        whole, tail, pick = (_blocks(n, ours, 7) for n in range(len(rids)))
        for rid in rids:
            consumer.expect(rid, f"p-sub-{kind}")
        got = consumer.receive_blocks(rids[0], TOKENS, whole)
        consumer.receive_blocks(rids[1], TOKENS, tail, first_block=2)  # its first 2 blocks are ours already
        consumer.receive_blocks(rids[2], TOKENS, pick, pick=[1, 3])  # the blocks at these positions only
        assert got.kv_bytes == LAYERS * HEADS * TOKENS * 2 * HEAD_DIM * 4 + \
            LAYERS * HEADS * (-TOKENS % min(theirs, ours)) * 2 * HEAD_DIM * 4  # every token, the last block whole
        assert holds(tensors, rids[0], whole, ours)
        assert holds(tensors, rids[1], tail, ours, first=2 * ours)
        assert not any(bool(t[tail[:2]].any()) for t in tensors.values()), "blocks before the tail written"
        for position, block in enumerate(pick):
            in_it = range(position * ours, min(TOKENS, (position + 1) * ours))
            picked = all(torch.equal(read_kv(t, block, h, tok % ours).cpu(), token_kv(rids[2], layer, h, tok))
                         for layer, t in enumerate(tensors.values()) for tok in in_it for h in range(HEADS))
            assert picked == (position in (1, 3)), position
        assert results.get(timeout=HOLD_S) is True, "a prompt waited for its hold deadline"
    finally:
        consumer.close()
        directory.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def prefill_rank(redis_url: str, kind: ConnectorKind, tp: int, rank: int, rid: str, results) -> None:
    """A prefill rank's process (TP `tp`, blocks of 8 tokens): hold the prompt's KV of its heads."""
    split = TPSplit(HEADS, tp)
    tensors = {f"layer.{i}": torch.zeros(BLOCKS, split.per_rank, 8, 2 * HEAD_DIM) for i in range(LAYERS)}
    blocks = _blocks(rank, 8, 0)
    for layer, t in enumerate(tensors.values()):
        for tok in range(TOKENS):
            for local in range(split.per_rank):
                put(t, blocks[tok // 8], local, tok % 8, token_kv(rid, layer, split.first_head(rank) + local, tok))
    config = _config(kind, NodeRole.PREFILL, rank_node_id("p-tp-sub", rank, tp), redis_url)
    directory = KVDirectory(redis_url)
    epoch = directory.next_epoch(config.node_id)
    producer = KVProducer(config, directory, epoch, create_transport(config, epoch), region_of(tensors, BLOCKS, 8))
    producer.hold(rank_key(rid, rank, tp), blocks, TOKENS)
    results.put("held")
    results.put(len(peer.wait_released(producer, 1, HOLD_S / 2)) == 1)
    producer.close()
    directory.close()
    peer.flush_replies()


def _decode_rank(redis_url: str, kind: ConnectorKind, rid: str, p_tp: int, d_tp: int, rank: int) -> None:
    """A decode rank (blocks of 4 tokens): pull its heads' share of each prefill rank's copy and hold every one of
    their tokens where it keeps them."""
    decode = TPSplit(HEADS, d_tp)
    tensors = {f"layer.{i}": torch.zeros(BLOCKS, decode.per_rank, 4, 2 * HEAD_DIM) for i in range(LAYERS)}
    config = _config(kind, NodeRole.DECODE, rank_node_id("c-tp-sub", rank, d_tp), redis_url)
    directory = KVDirectory(redis_url)
    consumer = KVConsumer(config, directory, create_transport(config, directory.next_epoch(config.node_id)),
                          region_of(tensors, BLOCKS, 4))
    dst = _blocks(2, 4, 3 + rank)
    try:
        for pull in plan(TPSplit(HEADS, p_tp), decode, rank):
            key = rank_key(rid, pull.rank, p_tp)
            consumer.expect(key, rank_node_id("p-tp-sub", pull.rank, p_tp))
            consumer.receive_blocks(key, TOKENS, dst, heads=pull.heads)
    finally:
        consumer.close()
        directory.close()
    for layer, t in enumerate(tensors.values()):
        for local in range(decode.per_rank):
            head = decode.first_head(rank) + local
            assert all(torch.equal(read_kv(t, dst[tok // 4], local, tok % 4), token_kv(rid, layer, head, tok))
                       for tok in range(TOKENS)), (rank, layer, head)


@pytest.mark.parametrize("kind", [ConnectorKind.SHM, ConnectorKind.UCX, ConnectorKind.TCP])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_tensor_parallel_ranks_pull_their_heads_between_block_sizes(kind, p_tp, d_tp, redis_url):
    """Prefill ranks of 8-token blocks, decode ranks of 4-token blocks (one after the other here), each reading its
    heads' share of each prefill rank's copy; every copy released once read."""
    rid = f"tp-{kind}-{p_tp}-{d_tp}"
    results = CTX.Queue()
    ranks = [CTX.Process(target=prefill_rank, args=(redis_url, kind, p_tp, r, rid, results)) for r in range(p_tp)]
    for proc in ranks:
        proc.start()
    try:
        assert [results.get(timeout=60) for _ in ranks] == ["held"] * p_tp
        for rank in range(d_tp):
            _decode_rank(redis_url, kind, rid, p_tp, d_tp, rank)
        assert [results.get(timeout=HOLD_S) for _ in ranks] == [True] * p_tp, "a copy waited for its hold deadline"
    finally:
        for proc in ranks:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
