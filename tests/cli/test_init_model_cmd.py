"""`kvwire init-model`: every preset's family loads in transformers and matches kvwire; a chat template always."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from kvwire.cli.main import app
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.engine.byte_tokenizer_files import CHAT_TEMPLATE
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import PRESETS, Architecture, kv_layout

runner = CliRunner()
PROMPT = list(b"Hello from a tiny random model.")
FAMILY_PRESETS = {"tiny-llama3": Architecture.LLAMA, "tiny-mistral": Architecture.MISTRAL,
                  "tiny-qwen2": Architecture.QWEN2, "tiny-qwen3": Architecture.QWEN3}


def _our_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """kvwire's logits of one prompt step, `[T, vocab]`."""
    model = load_model(path)
    pool = KVPool.allocate(kv_layout(model.config, 16), num_blocks=4)
    hidden = model(ModelInput([SequenceInput("p", tokens, 0, [0, 1, 2, 3])], is_prompt=True), pool.kv_caches)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("preset", sorted(FAMILY_PRESETS))
def test_family_preset_loads_in_transformers(preset: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["init-model", str(tmp_path), "--preset", preset, "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert str(FAMILY_PRESETS[preset]) in result.output
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert not (tmp_path / "tokenizer.json").exists()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(hf).__name__ == str(FAMILY_PRESETS[preset])
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([PROMPT])).logits[0].float()  # [T, vocab]
    torch.testing.assert_close(_our_logits(tmp_path, PROMPT), ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.5


def test_tiny_preset_still_writes_llama_and_tokenizer_template(tmp_path: Path) -> None:
    result = runner.invoke(app, ["init-model", str(tmp_path), "--hf-tokenizer"])  # --preset tiny by default
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert load_model(tmp_path).config == PRESETS["tiny"]


def test_unknown_preset_is_refused(tmp_path: Path) -> None:
    result = runner.invoke(app, ["init-model", str(tmp_path), "--preset", "tiny-gpt2"])
    assert result.exit_code == 2
    assert "tiny-qwen3" in result.output and not (tmp_path / "config.json").exists()
