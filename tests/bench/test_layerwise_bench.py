"""`kvwire bench transfer --layerwise` at a small size: two processes with TCP or UCX connectors and a real
redis-server, bytes verified, figures consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvwire.bench.choices import Placement
from kvwire.bench.layerwise import bench_layerwise
from kvwire.bench.workload import Workload
from kvwire.connectors.config import ConnectorKind

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", [ConnectorKind.TCP, ConnectorKind.UCX])
def test_layerwise_result_is_verified_and_consistent(redis_url, kind):
    r = bench_layerwise(Workload(64, Placement.SCATTERED), kind, runs=2, warmup=1, compute_ms=2.0, redis_url=redis_url)
    assert r.method == kind and r.verified and r.layers == 32
    assert r.compute_ms_per_layer == 2.0 and r.prefill_ms == 64.0
    assert r.layer_transfer_ms == pytest.approx(r.transfer_ms / 32, abs=0.01)
    assert r.tail_ms > 0 and r.hidden_fraction == pytest.approx(1 - r.tail_ms / r.transfer_ms, abs=0.01)


def test_cli_layerwise_json():
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "transfer", "--layerwise",
                           "--tokens", "32", "--layouts", "contiguous", "--pools", "vllm", "--methods", "ucx,nixl",
                           "--runs", "1", "--warmup", "0", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = json.loads(done.stdout)
    assert row["verified"] and row["pool"] == "vllm" and row["tokens"] == 32 and row["method"] == "ucx"
