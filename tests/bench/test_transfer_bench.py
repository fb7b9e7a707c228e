"""`kvwire bench transfer` at a tiny size: every row verified, limits and a connector side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.transfer import Method, bench_transfer
from bench.workload import Placement, Workload

pytestmark = pytest.mark.slow


def test_workload_places_blocks_as_asked():
    scattered, contiguous = Workload(2048, Placement.SCATTERED), Workload(2048, Placement.CONTIGUOUS)
    assert scattered.num_blocks == 128 and scattered.pool_blocks == 256
    assert scattered.block_ids(0) != scattered.block_ids(1) and len(set(scattered.block_ids(1))) == 128
    assert contiguous.block_ids(0) == contiguous.block_ids(1) == list(range(128))


def test_rows_are_verified_for_limits_and_a_connector(redis_url):
    rows = bench_transfer([Method.LIMIT_MEMCPY, Method.LIMIT_TCP, Method.TCP], [32], [Placement.SCATTERED],
                          runs=2, warmup=0, redis_url=redis_url)
    assert [r.method for r in rows] == ["limit-memcpy", "limit-tcp", "tcp"]
    for r in rows:
        assert r.verified and r.runs == 2 and r.bytes == 2 * 2 * 1024 * 1024  # 2 blocks of 2 MiB
        assert 0 < r.gbps_min <= r.gbps_median <= r.gbps_max


def test_cli_prints_json_rows():
    done = subprocess.run([sys.executable, "-m", "cli.main", "bench", "transfer", "--tokens", "16", "--methods",
                           "limit-memcpy,ucx", "--layouts", "contiguous", "--runs", "1", "--warmup", "0", "--json"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert {r["method"] for r in rows} == {"limit-memcpy", "ucx"}
    assert all(r["verified"] and r["layout"] == "contiguous" and r["pool"] == "kvwire" for r in rows)
