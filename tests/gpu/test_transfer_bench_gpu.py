"""`kvwire bench transfer --device cuda`: pools on the GPU, the device's own copy next to the connectors
that move device memory between two processes on it and NIXL reading VRAM, every run's bytes verified."""

from __future__ import annotations

import pytest
import torch

from kvwire.bench.choices import Device, Method, Placement
from kvwire.bench.nixl_run import nixl_module
from kvwire.bench.transfer import bench_transfer
from kvwire.connectors.wire import PoolLayout

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")
def test_gpu_pools_are_moved_and_verified(redis_url):
    methods = [Method.LIMIT_MEMCPY, Method.NIXL, Method.UCX, Method.SHM, Method.TCP, Method.NIXL_TCP]
    rows = bench_transfer(methods, [32], [Placement.SCATTERED], [PoolLayout.KVWIRE], runs=2, warmup=1,
                          redis_url=redis_url, device=Device.CUDA)
    nixl = ["nixl"] if nixl_module() else []  # nixl-tcp is a host baseline
    assert [r.method for r in rows] == ["limit-memcpy", *nixl, "ucx", "shm", "tcp"]
    assert all(r.error is None and r.verified and r.device == "cuda" and r.runs == 2 for r in rows), \
        [r.error for r in rows]


@pytest.mark.skipif(GPUS < 1 or nixl_module() is None, reason=f"needs a CUDA device (found {GPUS}) and NIXL")
def test_nixl_reads_vram_of_both_pools_and_names_the_ucx_protocol(redis_url):
    rows = bench_transfer([Method.NIXL, Method.NIXL_DEFAULTS], [32], [Placement.SCATTERED],
                          [PoolLayout.KVWIRE, PoolLayout.VLLM], runs=2, warmup=1, redis_url=redis_url,
                          device=Device.CUDA)
    assert [(r.method, r.pool) for r in rows] == [("nixl", "kvwire"), ("nixl-defaults", "kvwire"),
                                                  ("nixl", "vllm"), ("nixl-defaults", "vllm")]
    for r in rows:
        assert r.error is None and r.verified and r.runs == 2, r.error
        assert r.protocol is not None and r.protocol.startswith("remote memory read") and "cuda" in r.protocol, \
            r.protocol
