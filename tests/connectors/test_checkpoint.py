"""A checkpoint's fingerprint: the same for the same weights however stored or named, another for other weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvwire.connectors.checkpoint import model_fingerprint
from kvwire.engine.init_model import write_random_checkpoint


def _fp(path: Path) -> str:
    return model_fingerprint(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp") / "a"
    write_random_checkpoint(path, "tiny", 0)
    return path


def test_a_copy_and_a_resharded_copy_agree(base, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    config = json.loads((copy / "config.json").read_text())
    config["_name_or_path"], config["transformers_version"] = "/elsewhere/llama", "9.9.9"  # saved elsewhere
    (copy / "config.json").write_text(json.dumps(config))
    assert _fp(copy) == _fp(base) and len(_fp(base)) == 16
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(base / "config.json", sharded / "config.json")
    tensors = load_file(str(base / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _fp(sharded) == _fp(base)


def test_other_weights_or_another_architecture_of_the_same_shape_differ(base, tmp_path):
    write_random_checkpoint(tmp_path / "seed1", "tiny", 1)
    write_random_checkpoint(tmp_path / "qwen2", "tiny-qwen2", 0)
    assert len({_fp(base), _fp(tmp_path / "seed1"), _fp(tmp_path / "qwen2")}) == 3


def test_one_changed_tensor_changes_it(base, tmp_path):
    tuned = tmp_path / "tuned"
    shutil.copytree(base, tuned)
    tensors = load_file(str(tuned / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name] + 0.01  # a fine-tune of one matrix
    save_file(tensors, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    assert _fp(tuned) != _fp(base)


def test_a_file_that_is_not_safetensors_is_refused(base, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(base / "config.json", bad / "config.json")
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a safetensors file"):
        _fp(bad)


def test_a_vllm_model_is_known_by_its_files_where_found_else_by_its_name(base, monkeypatch, tmp_path):
    from kvwire.connectors.checkpoint import name_fingerprint
    from kvwire.connectors.vllm.identity import checkpoint_of

    assert checkpoint_of(str(base), None) == _fp(base)  # a directory: what kvwire's own nodes say of it
    import huggingface_hub.constants

    # read when called (the environment only when huggingface_hub is first imported)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    name = checkpoint_of("no-such-org/no-such-model", "main")  # not in the cache: its name and revision
    assert name == name_fingerprint("no-such-org/no-such-model", "main") != checkpoint_of("no-such-org/other", "main")
    repo = tmp_path / "empty-cache" / "models--org--tiny"  # a hub id vLLM downloaded: its files in the cache
    shutil.copytree(base, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert checkpoint_of("org/tiny", None) == _fp(base)
