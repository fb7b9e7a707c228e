"""Random checkpoints: deterministic, loadable by transformers, and not degenerate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvwire.engine.init_model import EMITTED_BYTES, write_random_checkpoint
from kvwire.engine.model_config import PRESETS

PROMPTS = ["Hello, world", "The quick brown fox", "abc", "1234567890", "kvwire",
           "Once upon a time", "x", "disaggregated prefill"]


def test_same_seed_same_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    config = write_random_checkpoint(tmp_path / "again", "tiny", 0)
    assert config == PRESETS["tiny"]
    again = (tmp_path / "again" / "model.safetensors").read_bytes()
    assert again == (tiny_dir / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "config.json").read_text() == (tiny_dir / "config.json").read_text()
    write_random_checkpoint(tmp_path / "other", "tiny", 1)
    a = load_file(str(tiny_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "other" / "model.safetensors"))
    assert a.keys() == b.keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[name], b[name])


def test_unknown_preset_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="tiny") as err:
        write_random_checkpoint(tmp_path, "huge", 0)
    assert "huge" in str(err.value) and "small" in str(err.value)
    assert not (tmp_path / "model.safetensors").exists()


def test_transformers_loads_without_missing_keys(tiny_dir: Path) -> None:
    model, info = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.num_hidden_layers == PRESETS["tiny"].num_hidden_layers


def test_greedy_continuations_are_not_degenerate(make_runner) -> None:
    runner = make_runner(num_blocks=64, block_size=16)
    outputs = [runner.greedy(list(p.encode()), 16) for p in PROMPTS]
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)  # every prompt continues differently
    for out in outputs:
        assert len(set(out)) >= 4, out  # not one token (nor a pair) repeated
        assert all(a != b for a, b in zip(out, out[1:])), out
        assert set(out) <= set(EMITTED_BYTES)  # printable text, no specials
