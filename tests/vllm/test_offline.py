"""Fast checks through one offline vLLM `LLM` (one process, no servers): KV that never comes is recomputed.

The process (offline_consumer.py) starts as the session starts (conftest.py's `_offline_run_starting`); the test
reads what it printed.
"""

from __future__ import annotations

import json

from tests.vllm.conftest import OFFLINE_DEADLINE_S


def test_consumer_recomputes_what_never_arrives(offline_run: tuple[int, str, str]):
    returncode, stdout, stderr = offline_run
    assert returncode == 0, stderr[-4000:]
    runs = {r["case"]: r for r in map(json.loads, (line for line in stdout.splitlines() if line.startswith("{")))}
    assert set(runs) == {"plain", "no-producer", "failed-entry", "malformed", "mismatched"}, stdout[-4000:]
    plain = runs["plain"]["tokens"]
    assert len(plain) == 16
    for case, run in runs.items():
        assert run["tokens"] == plain, f"{case}: {run['tokens']} != {plain}"
    assert runs["no-producer"]["seconds"] >= OFFLINE_DEADLINE_S, "waited for the KV until kv_deadline_s"
    for case in ("failed-entry", "malformed", "mismatched"):  # recomputed at once, not at the deadline
        assert runs[case]["seconds"] < OFFLINE_DEADLINE_S / 2, (case, runs[case]["seconds"])
