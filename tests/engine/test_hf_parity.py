"""Our paged Llama against transformers' LlamaForCausalLM on the same random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvwire.connectors.model_input import SequenceInput
from kvwire.engine.init_model import write_checkpoint
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import PRESETS

PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice.")


def _hf_model(path: Path) -> transformers.LlamaForCausalLM:
    model, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path: Path, tied: bool, make_runner) -> None:
    config = PRESETS["tiny"].replace(tie_word_embeddings=tied)
    write_checkpoint(tmp_path, config, seed=3)
    hf = _hf_model(tmp_path)
    runner = make_runner(model=load_model(tmp_path), block_size=16)
    blocks = list(reversed(runner.blocks_for(len(PROMPT))))  # scattered on purpose
    ours = runner.logits(SequenceInput("p", PROMPT, 0, blocks))  # [T, vocab]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()  # [T, vocab]
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.5  # the comparison is not between near-zero logits


def test_decode_steps_match_transformers(tiny_dir: Path, runner) -> None:
    hf = _hf_model(tiny_dir)
    prompt, extra = PROMPT[:20], PROMPT[20:30]
    blocks = runner.blocks_for(len(prompt) + len(extra))
    rows = [runner.logits(SequenceInput("d", prompt, 0, blocks))[-1]]
    for i, tok in enumerate(extra):
        rows.append(runner.logits(SequenceInput("d", [tok], len(prompt) + i, blocks))[0])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + extra])).logits[0, len(prompt) - 1:]  # [11, vocab]
    torch.testing.assert_close(torch.stack(rows), ref, atol=1e-4, rtol=0)


def test_hf_config_is_llama(tiny_dir: Path) -> None:
    hf_config = transformers.AutoConfig.from_pretrained(tiny_dir)
    ours = PRESETS["tiny"]
    assert isinstance(hf_config, transformers.LlamaConfig)
    assert hf_config.num_key_value_heads == ours.num_key_value_heads == 2
    assert hf_config.head_dim == ours.head_dim
    assert hf_config.tie_word_embeddings is False
