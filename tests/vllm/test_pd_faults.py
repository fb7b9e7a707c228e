"""The prefill vLLM server SIGKILLed with requests in flight: every request still gets the plain tokens.

Some requests are mid-way through the router when the prefill server dies; three more had their
KV computed and held (their kv_transfer_params handed out) but not pulled yet. Decode recomputes
what it cannot pull; afterwards no directory entry is left READY and every one expires.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from kvwire.cluster.vllm_cluster import VLLMServer
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from tests.vllm.conftest import PROMPTS
from tests.vllm.pd import pd_cluster

MAX_TOKENS = 16
PROMPT_MIX = [p + f" variant {i}." for i in range(3) for p in PROMPTS]  # 9 distinct prompts


def _body(model: str, prompt: str, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _text(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_prefill_killed_mid_load(plain_server: VLLMServer, vllm_model_dir: Path, redis_url: str, tmp_path: Path):
    model = str(vllm_model_dir)
    want = {p: _text(plain_server.url, _body(model, p)) for p in PROMPT_MIX}
    with pd_cluster(vllm_model_dir, redis_url, ConnectorKind.TCP, tmp_path, kv_deadline_s=10.0) as cluster:
        held = {}  # computed on prefill, handed over, not pulled yet
        for p in PROMPT_MIX[:3]:
            body = _body(model, p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            r = httpx.post(f"{cluster.prefill.url}/v1/completions", json=body, timeout=60)
            held[p] = r.json()["kv_transfer_params"]
            assert held[p]["do_remote_prefill"] and held[p]["remote_engine_id"] == "prefill-tcp"
        with ThreadPoolExecutor(len(PROMPT_MIX)) as pool:
            routed = {p: pool.submit(_text, cluster.router_url, _body(model, p)) for p in PROMPT_MIX}
            time.sleep(0.5)  # some of them are on the prefill server now
            cluster.prefill.kill()
            late = {p: pool.submit(_text, cluster.decode.url, _body(model, p, kv_transfer_params=params))
                    for p, params in held.items()}
            got = {p: f.result(timeout=120) for p, f in routed.items()}
            got_late = {p: f.result(timeout=120) for p, f in late.items()}
        assert got == want
        assert got_late == {p: want[p] for p in held}
        assert cluster.router.poll() is None and httpx.get(f"{cluster.decode.url}/health").status_code == 200
    _no_entry_left_ready(redis_url)


def _no_entry_left_ready(redis_url: str) -> None:
    directory = KVDirectory(redis_url)
    try:
        entries = directory.entries_with_age()
        assert entries, "the held requests left entries (FAILED by the consumer)"
        ready = [a.entry.request_id for a in entries if a.entry.state == TransferState.READY]
        assert not ready, f"entries of a dead producer still READY: {ready}"
    finally:
        directory.close()
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [*client.scan_iter("*:req:*"), *client.scan_iter("*:ev:*")]  # a request's keys (directory.py)
        ttls = {k: client.ttl(k) for k in keys}
        assert all(t > 0 for t in ttls.values()), f"keys that never expire: {[k for k, t in ttls.items() if t <= 0]}"
    finally:
        client.close()


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
