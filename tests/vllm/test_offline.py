"""Fast checks through one offline vLLM `LLM` (one process, no servers): KV that never comes is recomputed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.vllm.conftest import PROMPTS

DEADLINE_S = 10.0  # far above a generate() on a busy machine, so "waited for it" and "at once" stay apart


def test_consumer_recomputes_what_never_arrives(vllm_model_dir: Path, redis_url: str):
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_consumer.py")), str(vllm_model_dir),
                          redis_url, PROMPTS[0], str(DEADLINE_S)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    runs = {r["case"]: r for r in map(json.loads, (line for line in out.stdout.splitlines() if line.startswith("{")))}
    assert set(runs) == {"plain", "no-producer", "failed-entry", "malformed", "mismatched"}, out.stdout
    plain = runs["plain"]["tokens"]
    assert len(plain) == 16
    for case, run in runs.items():
        assert run["tokens"] == plain, f"{case}: {run['tokens']} != {plain}"
    assert runs["no-producer"]["seconds"] >= DEADLINE_S, "waited for the KV until kv_deadline_s"
    for case in ("failed-entry", "malformed", "mismatched"):  # recomputed at once, not at the deadline
        assert runs[case]["seconds"] < DEADLINE_S / 2, (case, runs[case]["seconds"])
