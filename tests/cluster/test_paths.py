"""The default tiny checkpoint: written whole, with a chat template, once however many start at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kvwire.cluster.paths import default_model_dir
from kvwire.engine.byte_tokenizer_files import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE
from kvwire.router.chat_template import ChatTemplate


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_first_use_writes_a_checkpoint_that_chats(cache: Path) -> None:
    path = default_model_dir()
    assert path == cache / "kvwire" / "models" / "tiny-seed0"
    assert (path / "config.json").is_file() and load_file(str(path / "model.safetensors"))
    assert (path / CHAT_TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
    assert ChatTemplate(path).source == CHAT_TEMPLATE, "the router finds it"
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-seed0"], "no staging left behind"


def test_a_checkpoint_without_a_template_gets_one_and_keeps_its_weights(cache: Path) -> None:
    path = default_model_dir()
    (path / CHAT_TEMPLATE_FILE).unlink()
    weights = (path / "model.safetensors").read_bytes()
    assert default_model_dir() == path
    assert (path / CHAT_TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
    assert (path / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-seed0"]


def test_processes_started_at_once_each_load_a_whole_checkpoint(cache: Path) -> None:
    script = ("import sys; from safetensors.torch import load_file; from kvwire.cluster.paths import "
              "default_model_dir; p = default_model_dir(); load_file(str(p / 'model.safetensors')); print(p)")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(cache / "kvwire" / "models" / "tiny-seed0")}
    assert sorted(p.name for p in (cache / "kvwire" / "models").iterdir()) == ["tiny-seed0"]
