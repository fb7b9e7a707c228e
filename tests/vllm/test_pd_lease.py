"""Delayed free on the prefill server: KV handed over is held until pulled, or until its lease lapses.

Two prompts are computed with do_remote_decode and never pulled: their blocks stay in use
(vLLM's KV cache usage above zero) until kv_deadline_s, then the connector reports them
finished sending, vLLM frees them, and their directory entries say EXPIRED.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from kvwire.cluster.vllm_cluster import VLLMServer
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from tests.vllm.conftest import PROMPTS
from tests.vllm.pd import pd_cluster

LEASE_S = 4.0


def _usage(server: VLLMServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)[1])


def test_unpulled_kv_is_held_until_its_lease_lapses(vllm_model_dir: Path, redis_url: str, tmp_path: Path):
    model = str(vllm_model_dir)
    with pd_cluster(vllm_model_dir, redis_url, ConnectorKind.TCP, tmp_path, kv_deadline_s=LEASE_S) as cluster:
        ids = []
        for prompt in PROMPTS[:2]:
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            r = httpx.post(f"{cluster.prefill.url}/v1/completions", json=body, timeout=60)
            ids.append(r.json()["kv_transfer_params"]["remote_request_id"])
        time.sleep(1.0)  # metrics are published once a step
        assert _usage(cluster.prefill) > 0, "the blocks handed over are still in use (delayed free)"
        deadline = time.monotonic() + LEASE_S + 15
        while _usage(cluster.prefill) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _usage(cluster.prefill) == 0, "the blocks were freed once the lease lapsed"
        directory = KVDirectory(redis_url)
        try:
            states = {rid: directory.get(rid) for rid in ids}
        finally:
            directory.close()
        assert all(e is not None and e.state == TransferState.EXPIRED for e in states.values()), states
