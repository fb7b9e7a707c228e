"""Prefill and decode on GPUs: outputs must equal a single-GPU run of the same prompts.

Two-GPU cases put prefill on cuda:0 and decode on cuda:1; single-GPU cases put both
processes on cuda:0 (for the transports that allow it: NCCL does not allow two ranks
on one device). They skip where the GPUs are missing.
"""

from __future__ import annotations

import pytest
import torch

from kvwire.cli.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.wire import SamplingParams
from kvwire.engine.reference import generate
from tests.integration.cluster import complete_all

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
PROMPTS = [[72], list(range(40, 56)), list(range(33)), list(range(100, 200)) * 11]


def _run(model_dir, connector: str, prefill_device: str, decode_device: str, tmp_path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = generate(model_dir, PROMPTS, params, device="cuda:0")
    spec = ClusterSpec(model_dir=model_dir, connector=connector, prefill_device=prefill_device,
                       decode_device=decode_device, log_dir=tmp_path / "logs")
    with LocalCluster(spec) as cluster:
        results = complete_all(cluster.url, PROMPTS, max_tokens=12)
    for want, got in zip(expected, results):
        assert got["choices"][0]["token_ids"] == want
        assert got["kvwire"]["bypassed"] is True


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, found {GPUS}")
@pytest.mark.parametrize("connector", ["ucx", "nccl", "shm"])
def test_prefill_on_gpu0_decode_on_gpu1(tiny_model_dir, tmp_path, connector):
    _run(tiny_model_dir, connector, "cuda:0", "cuda:1", tmp_path)


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device, found {GPUS}")
@pytest.mark.parametrize("connector", ["ucx", "shm"])
def test_both_nodes_on_one_gpu(tiny_model_dir, tmp_path, connector):
    _run(tiny_model_dir, connector, "cuda:0", "cuda:0", tmp_path)
