"""Paged attention equals one unpaged forward of the whole sequence, whatever the block table."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.model_input import ModelInput, SequenceInput

SEQ = list(b"Paged attention must not care where a sequence's blocks live.")  # 61 tokens
PROMPT_LEN = 13


def _full_logits(make_runner) -> torch.Tensor:
    """`[len(SEQ), vocab]` from one prompt step over contiguous blocks of 64 tokens."""
    full = make_runner(num_blocks=2, block_size=64)
    return full.logits(SequenceInput("full", SEQ, 0, [0, 1]))


def test_prefill_then_decode_equals_full_forward(make_runner) -> None:
    runner = make_runner(num_blocks=32, block_size=4)
    blocks = [17, 3, 29, 8, 0, 31, 12, 5, 22, 1, 26, 9, 14, 30, 6, 19]  # non-monotonic, 64 slots
    rows = [runner.logits(SequenceInput("s", SEQ[:PROMPT_LEN], 0, blocks))]
    for pos in range(PROMPT_LEN, len(SEQ)):  # crosses 12 block boundaries
        rows.append(runner.logits(SequenceInput("s", [SEQ[pos]], pos, blocks)))
    paged = torch.cat(rows)  # [len(SEQ), vocab]
    torch.testing.assert_close(paged, _full_logits(make_runner), atol=1e-5, rtol=0)


def test_chunked_prefill_equals_full_forward(make_runner) -> None:
    runner = make_runner(num_blocks=32, block_size=4)
    blocks = list(range(31, 15, -1))
    cuts = [0, 5, 6, 18, 40, len(SEQ)]  # chunks of 5, 1, 12, 22, 21 tokens
    rows = [runner.logits(SequenceInput("c", SEQ[a:b], a, blocks)) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(rows), _full_logits(make_runner), atol=1e-5, rtol=0)


def test_kv_lands_in_the_sequences_slots_only(make_runner) -> None:
    runner = make_runner(num_blocks=16, block_size=4)
    blocks = [9, 2, 14]  # 12 slots for 10 tokens
    runner.forward(SequenceInput("k", SEQ[:10], 0, blocks))
    written = runner.pool.data.abs().sum(dim=(1, 2, 4, 5))  # [num_blocks, block_size]
    expected = torch.zeros(16, 4, dtype=torch.bool)
    for pos in range(10):
        expected[blocks[pos // 4], pos % 4] = True
    assert torch.equal(written > 0, expected)


def test_kv_cache_matches_between_layouts(make_runner) -> None:
    """Layer 0's K/V depend on the token alone, so they are bit-identical wherever they sit."""
    a, b = make_runner(num_blocks=8, block_size=4), make_runner(num_blocks=4, block_size=8)
    a.forward(SequenceInput("x", SEQ[:20], 0, [7, 1, 4, 0, 6]))
    b.forward(SequenceInput("x", SEQ[:20], 0, [2, 0, 3]))
    kv_a = a.pool.kv_caches[0][[7, 1, 4, 0, 6]].transpose(0, 1).reshape(2, 20, -1)  # [2, tokens, kvh*d]
    kv_b = b.pool.kv_caches[0][[2, 0, 3]].transpose(0, 1).reshape(2, 24, -1)[:, :20]
    assert torch.equal(kv_a, kv_b)
    assert kv_a.abs().sum() > 0


def test_mixed_prompt_and_decode_batch(make_runner) -> None:
    runner = make_runner(num_blocks=32, block_size=4)
    b1, b2 = runner.blocks_for(len(SEQ)), runner.blocks_for(len(SEQ))
    runner.forward(SequenceInput("a", SEQ[:30], 0, b1))
    hidden = runner.forward(SequenceInput("a", SEQ[30:31], 30, b1), SequenceInput("b", SEQ[:31], 0, b2))
    logits = runner.model.compute_logits(hidden)  # [1 + 31, vocab]
    full = _full_logits(make_runner)
    torch.testing.assert_close(logits[0], full[30], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1:], full[:31], atol=1e-5, rtol=0)


def test_bad_inputs_raise(runner) -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward(SequenceInput("short", SEQ[:9], 0, [0, 1]))  # 8 slots for 9 tokens
    with pytest.raises(ValueError, match="outside a pool of 64"):
        runner.forward(SequenceInput("pool", SEQ[:9], 0, [0, 1, 64]))
    with pytest.raises(ValueError, match="token ids"):
        runner.forward(SequenceInput("vocab", [0, 5000], 0, [0]))
    with pytest.raises(ValueError, match="KV caches"):
        runner.model(ModelInput([SequenceInput("l", [1], 0, [0])]), runner.pool.kv_caches[:1])
    too_far = runner.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="positions"):
        runner.forward(SequenceInput("far", [1], too_far, list(range(64))))
