"""`kvwire bench transfer --device cuda`: pools on the GPU, the device's own copy next to the connectors
that move device memory between two processes on it, every run's bytes verified."""

from __future__ import annotations

import pytest
import torch

from kvwire.bench.choices import Device, Method, Placement
from kvwire.bench.transfer import bench_transfer
from kvwire.connectors.wire import PoolLayout

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")
def test_gpu_pools_are_moved_and_verified(redis_url):
    methods = [Method.LIMIT_MEMCPY, Method.NIXL, Method.UCX, Method.SHM, Method.TCP]
    rows = bench_transfer(methods, [32], [Placement.SCATTERED], [PoolLayout.KVWIRE], runs=2, warmup=1,
                          redis_url=redis_url, device=Device.CUDA)
    assert [r.method for r in rows] == ["limit-memcpy", "ucx", "shm", "tcp"]  # NIXL is a host baseline here
    assert all(r.verified and r.device == "cuda" and r.runs == 2 for r in rows)
