"""`kvwire bench vllm` end to end, small: the session's plain server (`--plain-url`: one start-up fewer) and a
KvwireConnector pair over TCP that the bench starts.

One round of two prompts; NIXL left out (two more start-ups would double the test's time; its
row is checked where the bench runs for real). The JSON must hold the plain row and the pair's two
(its routers' dispatches, on the same servers), run, with every figure above zero, every answer
disaggregated, all KV pulled and the plain server's tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvwire.bench.vllm.setups import nixl_missing
from kvwire.cluster.vllm_cluster import VLLMServer

LENGTHS = (300, 420)


def test_bench_vllm_json(plain_server: VLLMServer, vllm_model_dir: Path, redis_url: str, tmp_path: Path):
    out = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "vllm", "--json", "--model",
                          str(vllm_model_dir), "--rounds", "1", "--prompt-tokens", ",".join(map(str, LENGTHS)),
                          "--max-tokens", "8", "--concurrency", "2", "--transports", "tcp", "--no-nixl",
                          "--redis-url", redis_url, "--log-dir", str(tmp_path), "--plain-url", plain_server.url],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    rows = {r["setup"]: r for r in result["rows"]}
    assert list(rows) == ["plain vLLM", "kvwire tcp", "kvwire tcp sequential"]
    for row in rows.values():
        assert row["ran"] and row["requests"] == len(LENGTHS) and row["concurrent_requests"] == len(LENGTHS), row
        for key in ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "throughput_tok_s"):
            assert row[key] > 0, (key, row)
    assert rows["plain vLLM"]["outputs_equal"] is None  # the baseline
    for pair in (rows["kvwire tcp"], rows["kvwire tcp sequential"]):
        assert pair["outputs_equal"] is True and pair["mismatched"] == []
        assert pair["disaggregated"] == 2 * len(LENGTHS) and pair["kv_pulled"] > 0.9, pair


def test_nixl_missing_names_a_package():
    missing = nixl_missing()
    assert missing is None or "`nixl" in missing
