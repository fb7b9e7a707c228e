"""Loading HF-format safetensors checkpoints, and the errors a bad one gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvwire.connectors.checkpoint import INDEX_FILE
from kvwire.engine.init_model import random_tensors, write_checkpoint
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import PRESETS


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loads_every_tensor(tiny_dir: Path, tiny_model) -> None:
    expected = load_file(str(tiny_dir / "model.safetensors"))
    state = tiny_model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[name], t) for name, t in expected.items())
    assert tiny_model.config == PRESETS["tiny"]


def test_missing_key_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    bad = _rewrite(tiny_dir, tmp_path / "bad", tensors)
    with pytest.raises(ValueError, match=r"missing keys model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(bad)


def test_unexpected_key_and_wrong_shape_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    tensors["model.layers.9.extra.weight"] = torch.zeros(3)
    tensors["model.norm.weight"] = torch.ones(7)
    bad = _rewrite(tiny_dir, tmp_path / "bad", tensors)
    with pytest.raises(ValueError) as err:
        load_model(bad)
    assert "unexpected keys model.layers.9.extra.weight" in str(err.value)
    assert "model.norm.weight: checkpoint (7,) != model (128,)" in str(err.value)


def test_sharded_checkpoint_with_rotary_buffers(tiny_dir: Path, tmp_path: Path, tiny_model) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(tiny_dir / "config.json", out / "config.json")
    for file, keys in shards.items():
        extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)} if "00001" in file else {}
        save_file({k: tensors[k] for k in keys} | extra, str(out / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = load_model(out)
    assert all(torch.equal(p, tiny_model.state_dict()[n]) for n, p in model.state_dict().items())


def test_tied_checkpoint_has_no_lm_head(tmp_path: Path) -> None:
    config = PRESETS["tiny"].replace(tie_word_embeddings=True)
    write_checkpoint(tmp_path, config, seed=1)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert model.lm_head is None
    assert model.lm_head_weight is model.model.embed_tokens.weight


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    config = PRESETS["tiny"].replace(tie_word_embeddings=True)
    tensors = random_tensors(config, seed=1)
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    write_checkpoint(tmp_path / "src", config, seed=1)
    bad = _rewrite(tmp_path / "src", tmp_path / "bad", tensors)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_model(bad)


def test_pickle_checkpoints_are_not_read(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
