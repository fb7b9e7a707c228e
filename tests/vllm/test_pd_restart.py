"""A prefill vLLM server's node id: never taken from it while it lives, taken over when it restarts.

A second server started under the live server's node id is refused at start-up, naming the live
one, and the live one goes on serving (it is not fenced). Then the live one is killed and restarted
under the same id: the entry of a prompt the first incarnation computed (its kv_transfer_params
handed out, its KV never pulled) is FAILED by the second one as it starts, so a decode server sent
that prompt recomputes it at once; the router takes the restarted server back and disaggregates again.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import httpx
import pytest

from kvwire.cluster.local_cluster import ClusterError
from kvwire.cluster.vllm_cluster import VLLMServer
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from tests.vllm.conftest import PROMPTS
from tests.vllm.pd import pd_cluster


def _body(model: str, prompt: str, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}


def test_a_live_prefills_id_is_refused_to_others_and_its_restart_fences_and_serves(
        plain_server: VLLMServer, vllm_model_dir: Path, redis_url: str, tmp_path: Path):
    model = str(vllm_model_dir)
    want = httpx.post(f"{plain_server.url}/v1/completions", json=_body(model, PROMPTS[1]), timeout=60).json()
    with pd_cluster(vllm_model_dir, redis_url, ConnectorKind.TCP, tmp_path, kv_deadline_s=20.0) as cluster:
        _duplicate_refused(cluster, tmp_path / "duplicate.log")
        _used_again(model, cluster)  # the live one was not fenced
        body = _body(model, PROMPTS[1], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = httpx.post(f"{cluster.prefill.url}/v1/completions", json=body, timeout=60).json()[
            "kv_transfer_params"]
        _wait_ready_entry(redis_url, params["remote_request_id"])  # held and announced: what the restart fences
        cluster.prefill.kill()
        restarted = VLLMServer(dataclasses.replace(cluster.prefill.spec, port=cluster.prefill.port)).start()
        try:
            restarted.wait_ready()
            _fenced_and_recomputed(model, redis_url, cluster.decode.url, params, want["choices"][0]["text"])
            _counted_where_vllm_users_look(cluster)
            _used_again(model, cluster)
        finally:
            restarted.stop()


def _duplicate_refused(cluster, log: Path) -> None:
    duplicate = VLLMServer(dataclasses.replace(cluster.prefill.spec, port=0, log_path=log)).start()
    try:
        with pytest.raises(ClusterError, match="exited during start-up"):
            duplicate.wait_ready()
    finally:
        duplicate.stop()
    said = f"kvwire: node id '{cluster.prefill.spec.node_id}' is in use by a live server (vllm prefill, pid "
    assert said in log.read_text(), log.read_text()[-3000:]


def _wait_ready_entry(redis_url: str, request_id: str, timeout_s: float = 10.0) -> None:
    """The producer announces KV one engine step after it answered; a busy machine makes that step late."""
    directory = KVDirectory(redis_url)
    try:
        entry = directory.wait_for(request_id, {TransferState.READY}, time.monotonic() + timeout_s)
    finally:
        directory.close()
    assert entry is not None and entry.state == TransferState.READY, entry


def _fenced_and_recomputed(model: str, redis_url: str, decode_url: str, params: dict, want: str) -> None:
    directory = KVDirectory(redis_url)
    try:
        entry = directory.get(params["remote_request_id"])
    finally:
        directory.close()
    assert entry is not None and entry.state == TransferState.FAILED and "restarted" in entry.reason, entry
    start = time.monotonic()
    got = httpx.post(f"{decode_url}/v1/completions", json=_body(model, PROMPTS[1], kv_transfer_params=params),
                     timeout=60).json()
    assert got["choices"][0]["text"] == want
    assert time.monotonic() - start < 10, "a fenced entry is recomputed at once, not at the KV deadline"


def _counted_where_vllm_users_look(cluster) -> None:
    """The recompute shows on the decode server's own /metrics, by reason (stats reach it a step later)."""
    deadline = time.monotonic() + 10
    while (failed := cluster.kv_failed_by_reason()).get("producer", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # vLLM records connector stats with its next engine step's
    assert failed["producer"] == 1 and sum(failed.values()) == 1, failed


def _used_again(model: str, cluster) -> None:
    before = cluster.prompt_tokens_by_source()
    deadline = time.monotonic() + 15  # the router's health check takes the restarted server back
    while True:
        r = httpx.post(f"{cluster.router_url}/v1/completions", json=_body(model, PROMPTS[2]), timeout=60)
        if r.headers["x-kvwire-path"] == "disaggregated" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.headers["x-kvwire-path"] == "disaggregated"
    after = cluster.prompt_tokens_by_source()
    assert after["external_kv_transfer"] > before["external_kv_transfer"]
