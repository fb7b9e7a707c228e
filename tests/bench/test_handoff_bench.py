"""`kvwire bench handoff` at a tiny size: two real engine processes, a row per prompt length."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvwire.bench.handoff import bench_handoff, demo_prompt_lengths
from kvwire.bench.prompts import PROMPTS

pytestmark = pytest.mark.slow


def test_each_length_is_timed_after_either_process(tiny_model_dir):
    results = bench_handoff(tiny_model_dir, [4, 40], rounds=2)
    assert [(r.tokens, r.rounds) for r in results] == [(4, 2), (40, 2)]
    for r in results:
        assert r.after_itself_ms_p50 > 0 and r.after_other_ms_p50 > 0
        assert r.ratio == pytest.approx(r.after_other_ms_p50 / r.after_itself_ms_p50, rel=0.01)


def test_cli_prints_json(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "handoff", "--model", str(tiny_model_dir),
                           "--tokens", "3", "--rounds", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["tokens"] for r in json.loads(done.stdout)] == [3]


def test_default_lengths_are_the_demo_prompts(tiny_model_dir):
    lengths = demo_prompt_lengths(tiny_model_dir)
    assert len(lengths) == len(PROMPTS) and all(n >= 1 for n in lengths)
    assert max(lengths) > 100  # the mix has a long prompt, as `bench e2e` sends
