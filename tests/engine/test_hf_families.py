"""Every supported family, saved by transformers, runs in kvwire as it runs in transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvwire.connectors.model_input import SequenceInput
from kvwire.connectors.wire import DType
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import Architecture
from kvwire.engine.rope import inv_freq
from tests.engine.hf_checkpoints import Family, make_hf_checkpoint

PROMPT = list(b"Pack my box with five dozen liquor jugs, then run.")
NEW_TOKENS = 32


class Case(NamedTuple):
    family: Family
    dtype: DType
    tied: bool
    overrides: dict[str, Any]


CASES = [
    Case(Family.LLAMA3, DType.FLOAT32, False, {}),
    Case(Family.LLAMA, DType.BFLOAT16, True, {"attention_bias": True}),
    Case(Family.MISTRAL, DType.FLOAT16, False, {}),
    Case(Family.MISTRAL, DType.FLOAT32, True, {}),
    Case(Family.QWEN2, DType.FLOAT32, True, {}),
    Case(Family.QWEN2, DType.BFLOAT16, False, {}),
    Case(Family.QWEN3, DType.FLOAT32, False, {}),
    Case(Family.QWEN3, DType.BFLOAT16, True, {"attention_bias": True}),
]
# absolute logit tolerance (logits have std ~2): float32 is exact up to summation order;
# half precisions round every activation, and the two engines round at different places
# (measured over three seeds: float32 <= 5e-6, float16 <= 6e-3, bfloat16 <= 0.08 logits, 0.13 logprobs)
LOGIT_ATOL = {DType.FLOAT32: 1e-4, DType.FLOAT16: 0.02, DType.BFLOAT16: 0.15}
LOGPROB_ATOL = {DType.FLOAT32: 1e-4, DType.FLOAT16: 0.02, DType.BFLOAT16: 0.2}
# a step's argmax must agree where transformers' top two logits are further apart than this
ARGMAX_MARGIN = {DType.FLOAT32: 0.0, DType.FLOAT16: 0.02, DType.BFLOAT16: 0.2}


def load_hf(path: Path, dtype: DType) -> transformers.PreTrainedModel:
    """transformers' model of a checkpoint, checked to load every tensor and no others."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, str(dtype)), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def greedy_with_logits(runner, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Our greedy continuation (a prompt step, then decode steps) and each step's logits `[max_tokens, vocab]`."""
    blocks = list(reversed(runner.blocks_for(len(prompt) + max_tokens)))  # scattered on purpose
    rows = [runner.logits(SequenceInput("g", prompt, 0, blocks))[-1]]
    out: list[int] = []
    for _ in range(max_tokens - 1):
        out.append(int(rows[-1].argmax()))
        rows.append(runner.logits(SequenceInput("g", [out[-1]], len(prompt) + len(out) - 1, blocks))[0])
    out.append(int(rows[-1].argmax()))
    return out, torch.stack(rows)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{c.dtype}-{'tied' if c.tied else 'untied'}")
def test_greedy_and_logits_match_transformers(case: Case, tmp_path: Path, make_runner) -> None:
    path = make_hf_checkpoint(case.family, tmp_path, case.dtype, case.tied, **case.overrides)
    hf = load_hf(path, case.dtype)
    ours = load_model(path)
    assert ours.config.dtype is case.dtype and ours.config.tie_word_embeddings is case.tied
    assert type(hf).__name__ == str(ours.config.architecture)
    tokens, logits = greedy_with_logits(make_runner(model=ours, block_size=16), PROMPT, NEW_TOKENS)
    with torch.no_grad():  # teacher-forced on our continuation
        ref = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:].float()  # [NEW_TOKENS, vocab]
    atol = LOGIT_ATOL[case.dtype]
    torch.testing.assert_close(logits, ref, atol=atol, rtol=0)
    top = ref.log_softmax(-1).topk(5)
    torch.testing.assert_close(logits.log_softmax(-1).gather(1, top.indices), top.values,
                               atol=LOGPROB_ATOL[case.dtype], rtol=0)
    assert_same_greedy(tokens, ref, margin=ARGMAX_MARGIN[case.dtype])
    assert ref.std() > 0.5  # not a comparison of near-zero logits
    assert case.tied or len(set(tokens)) > 3  # tied random models fall into loops; untied ones vary


def assert_same_greedy(tokens: list[int], ref: torch.Tensor, margin: float) -> None:
    """Our tokens are transformers' argmax wherever its top two logits are more than `margin` apart."""
    top2 = ref.topk(2).values  # [T, 2]
    decided = (top2[:, 0] - top2[:, 1]) > margin
    assert decided.float().mean() > 0.5  # most steps are decided, so the check has teeth
    argmax = ref.argmax(-1)
    mismatched = [i for i in range(len(tokens)) if decided[i] and argmax[i] != tokens[i]]
    assert not mismatched, (mismatched, tokens, argmax.tolist())


def test_llama3_inv_freq_is_transformers(tmp_path: Path) -> None:
    path = make_hf_checkpoint(Family.LLAMA3, tmp_path)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    config = load_model(path).config
    ours = inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    default = inv_freq(config.head_dim, config.rope_theta, None)
    assert (ours < default).sum() >= 3 and ours[0] == default[0]  # low frequencies scaled, high ones kept


def test_linear_rope_scaling_is_transformers(tmp_path: Path) -> None:
    path = make_hf_checkpoint(Family.LLAMA, tmp_path,
                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](transformers.AutoConfig.from_pretrained(path), "cpu")
    config = load_model(path).config
    torch.testing.assert_close(inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), ref,
                               atol=0, rtol=0)


def test_checkpoint_shapes_per_family(tmp_path: Path) -> None:
    qwen3 = load_model(make_hf_checkpoint(Family.QWEN3, tmp_path / "q3")).config
    assert qwen3.architecture is Architecture.QWEN3 and qwen3.head_dim == 24 != 64 // 4
    qwen2 = load_model(make_hf_checkpoint(Family.QWEN2, tmp_path / "q2"))
    attn = qwen2.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is None
    with pytest.raises(ValueError, match="sliding_window"):
        load_model(make_hf_checkpoint(Family.MISTRAL, tmp_path / "m", sliding_window=128))
