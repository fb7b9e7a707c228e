"""Prefill and decode on GPUs: outputs must equal a single-GPU run of the same prompts.

Two-GPU cases put prefill on cuda:0 and decode on cuda:1; single-GPU cases put both
processes on cuda:0 (for the transports that allow it: NCCL does not allow two ranks
on one device). They skip where the GPUs are missing.
"""

from __future__ import annotations

import httpx2
import pytest
import torch

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import complete_all

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
PROMPTS = [[72], list(range(40, 56)), list(range(33)), list(range(100, 200)) * 11]


def _run(model_dir, connector: str, prefill_device: str, decode_device: str, tmp_path,
         require_fast_path: bool = False) -> dict[str, str]:
    """Every prompt's output equals the single-GPU run's and skipped its forward on decode; each node's
    /readyz body (its start-up transport self-test)."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = generate(model_dir, PROMPTS, params, device="cuda:0")
    spec = ClusterSpec(model_dir=model_dir, connector=connector, prefill_device=prefill_device,
                       decode_device=decode_device, log_dir=tmp_path / "logs", require_fast_path=require_fast_path)
    with LocalCluster(spec) as cluster:
        results = complete_all(cluster.url, PROMPTS, max_tokens=12)
        ready = {role: httpx2.get(f"{cluster.ops_urls[role]}/readyz", timeout=10).text
                 for role in ("prefill", "decode")}
    for want, got in zip(expected, results):
        assert got["choices"][0]["token_ids"] == want
        assert got["kvwire"]["bypassed"] is True, got["kvwire"]
    return ready


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, found {GPUS}")
@pytest.mark.parametrize("connector", ["ucx", "nccl", "shm"])
def test_prefill_on_gpu0_decode_on_gpu1(tiny_model_dir, tmp_path, connector):
    _run(tiny_model_dir, connector, "cuda:0", "cuda:1", tmp_path)


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")
@pytest.mark.parametrize("connector", ["ucx", "shm"])
def test_both_nodes_on_one_gpu(tiny_model_dir, tmp_path, connector):
    _run(tiny_model_dir, connector, "cuda:0", "cuda:0", tmp_path)


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")
@pytest.mark.parametrize("connector", ["ucx", "shm", "auto"])
def test_one_gpu_nodes_pass_their_self_test_and_pull_over_the_fast_path(tiny_model_dir, tmp_path, connector):
    """Nodes whose pools are on the GPU: their start-up self-test (host memory) passes, and with
    --require-fast-path the decode node still takes every prompt's KV, so what carried it between the two
    processes on one GPU counted as shared memory (CUDA IPC), not the network stack."""
    ready = _run(tiny_model_dir, connector, "cuda:0", "cuda:0", tmp_path, require_fast_path=True)
    for role, body in ready.items():
        assert body.startswith("ready\n") and "FAILED" not in body, (role, body)
