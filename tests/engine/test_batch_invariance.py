"""A sequence's hidden states and logits are bit-identical whatever else shares its batch."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.model_input import SequenceInput
from kvwire.engine.ops import batch_invariant_linear, map_row_chunks, rms_norm

TARGET = list(b"batch invariance is what lets two processes agree")
OTHERS = [list(f"other sequence number {i} ".encode() * (i + 1)) for i in range(5)]  # 24 .. 120 tokens


def _decode_step(make_runner, num_others: int, target_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill everyone alone, then one decode step with the target among num_others others.

    Returns:
        The target's `[hidden]` and `[vocab]` from that step.
    """
    runner = make_runner(num_blocks=128, block_size=4)
    seqs = []
    for i, prompt in enumerate([TARGET] + OTHERS[:num_others]):
        blocks = runner.blocks_for(len(prompt) + 1)
        runner.forward(SequenceInput(f"s{i}", prompt[:-1], 0, blocks))
        seqs.append(SequenceInput(f"s{i}", prompt[-1:], len(prompt) - 1, blocks))
    if not target_first:
        seqs = seqs[1:] + seqs[:1]
    hidden = runner.forward(*seqs)  # [1 + num_others, hidden]
    row = 0 if target_first else num_others
    return hidden[row], runner.model.compute_logits(hidden)[row]


@pytest.mark.parametrize("target_first", [True, False], ids=["first", "last"])
def test_decode_step_is_batch_invariant(make_runner, target_first: bool) -> None:
    alone_hidden, alone_logits = _decode_step(make_runner, 0, True)
    for num_others in range(1, 6):
        hidden, logits = _decode_step(make_runner, num_others, target_first)
        assert torch.equal(hidden, alone_hidden), num_others
        assert torch.equal(logits, alone_logits), num_others


def test_prompt_step_is_batch_invariant(make_runner) -> None:
    alone = make_runner(num_blocks=32, block_size=4)
    ref = alone.forward(SequenceInput("t", TARGET, 0, alone.blocks_for(len(TARGET))))
    for num_others in (1, 3, 5):
        runner = make_runner(num_blocks=128, block_size=4)
        others = [SequenceInput(f"o{i}", p, 0, runner.blocks_for(len(p)))
                  for i, p in enumerate(OTHERS[:num_others])]
        target = SequenceInput("t", TARGET, 0, runner.blocks_for(len(TARGET)))
        hidden = runner.forward(*others[:1], target, *others[1:])
        start = len(OTHERS[0])
        assert torch.equal(hidden[start:start + len(TARGET)], ref), num_others


def test_linear_row_does_not_depend_on_batch_size_or_place() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(320, 128, generator=gen)  # [out, in]
    x = torch.randn(37, 128, generator=gen)  # [M, in]
    one = batch_invariant_linear(x[:1], w)
    for m in (2, 5, 16, 17, 37):
        assert torch.equal(batch_invariant_linear(x[:m], w)[:1], one)
        shuffled = torch.cat([x[1:m], x[:1]])  # the row at the end of a chunk instead
        assert torch.equal(batch_invariant_linear(shuffled, w)[-1:], one)
    torch.testing.assert_close(batch_invariant_linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5)


def test_row_ops_shapes_and_values() -> None:
    x = torch.randn(21, 64)
    weight = torch.rand(64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), ref)
    assert map_row_chunks(lambda c: c * 2, x[:0]).shape == (0, 64)
    assert torch.equal(map_row_chunks(lambda a, b: a + b, x, x), x + x)
