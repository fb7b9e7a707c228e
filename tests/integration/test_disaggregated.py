"""End to end: real redis-server, prefill node, decode node and router processes, KV over UCX.

(Every other connector runs the same cluster in test_every_connector.py.)"""

from __future__ import annotations

import json
import signal
import time

import httpx2
import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.cluster.ports import free_port
from kvwire.cluster.vllm_pd import counter_by_label
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import complete, complete_all, wait_pools_full_and_directory_empty
from tests.procs import FORK

pytestmark = pytest.mark.slow
BS = 16
# 1 token, 1 block exactly, k blocks exactly, k blocks + 1, odd sizes, and one over 1,000 tokens
PROMPTS = [[72], list(range(40, 40 + BS)), list(range(3 * BS)), list(range(2 * BS + 1)),
           [ord(c) for c in "Hello, disaggregated world"], list(range(100, 200)) * 11, [7, 8, 9],
           list(range(250, 5, -3))]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.UCX, block_size=BS, num_blocks=512,
                       log_dir=tmp_path_factory.mktemp("cluster-logs"), launch=FORK)
    with LocalCluster(spec) as c:
        yield c


def test_outputs_equal_single_process_and_prompts_are_bypassed(cluster, tiny_model_dir):
    assert len(PROMPTS[5]) > 1000
    expected = generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), block_size=BS)
    results = complete_all(cluster.url, PROMPTS, max_tokens=12)
    for prompt, want, got in zip(PROMPTS, expected, results):
        kv = got["kvwire"]
        assert got["choices"][0]["token_ids"] == want, f"prompt of {len(prompt)} tokens"
        assert kv["bypassed"] is True
        assert kv["kv_bytes"] > 0 and kv["transfer_ms"] > 0
        assert kv["prefill_node"] == "prefill-0" and kv["decode_node"] == "decode-0"
        assert (kv["path"], kv["reason"]) == ("disaggregated", "prefilled")
        assert got["usage"]["prompt_tokens"] == len(prompt)
    pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
    assert set(pools) == {"prefill-0", "decode-0"}
    asked = complete(cluster.url, PROMPTS[0], max_tokens=12, disaggregate=False)
    assert asked["choices"][0]["token_ids"] == expected[0]
    assert (asked["kvwire"]["path"], asked["kvwire"]["reason"], asked["kvwire"]["bypassed"]) == \
        ("decode-only", "not-asked", False)
    assert all(free == total for free, total in pools.values()), pools
    assert leftover == []


def test_a_router_with_decode_only_below_computes_short_prompts_on_decode(cluster, tiny_model_dir):
    """A second router in front of the same nodes, with `--decode-only-below 20`: a 3-token prompt goes
    decode-only (reason short-prompt, the decode node computes it), a 100-token one is disaggregated; both give
    the single-process tokens and the router's /metrics counts each path by its reason."""
    port = free_port()
    cluster.spawn("router-short", ["router", "--model", str(tiny_model_dir), "--redis-url", cluster.redis_url,
                                   "--port", str(port), "--decode-only-below", "20"])
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url)
    short, long_ = PROMPTS[6], PROMPTS[5][:100]
    expected = generate(tiny_model_dir, [short, long_], SamplingParams(max_tokens=12, temperature=0.0), block_size=BS)
    for prompt, want, path in ((short, expected[0], ("decode-only", "short-prompt", False, None)),
                               (long_, expected[1], ("disaggregated", "prefilled", True, "prefill-0"))):
        got = complete(url, prompt, max_tokens=12)
        kv = got["kvwire"]
        assert got["choices"][0]["token_ids"] == want
        assert (kv["path"], kv["reason"], kv["bypassed"], kv["prefill_node"]) == path
    counted = counter_by_label(url, "kvwire_path_reasons_total", "reason")
    assert counted["short-prompt"] == 1 and counted["prefilled"] == 1 and sum(counted.values()) == 2, counted


def _wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx2.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the second router at {url} is not ready")


def test_seeded_sampling_matches_single_process(cluster, tiny_model_dir):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234)
    expected = generate(tiny_model_dir, [PROMPTS[4]], params, block_size=BS)[0]
    got = complete(cluster.url, PROMPTS[4], max_tokens=10, temperature=0.9, seed=1234)
    assert got["choices"][0]["token_ids"] == expected
    assert got["kvwire"]["bypassed"] is True


def test_streaming_sends_the_same_text(cluster):
    whole = complete(cluster.url, "stream me", max_tokens=8)
    body = {"prompt": "stream me", "max_tokens": 8, "temperature": 0, "stream": True}
    events = []
    with httpx2.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["kvwire"]["bypassed"] is True
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_models_and_health(cluster):
    assert httpx2.get(f"{cluster.url}/healthz").json()["nodes"] == {"prefill": 1, "decode": 1}
    models = httpx2.get(f"{cluster.url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (json.dumps({"prompt": ""}).encode(), "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 10**9}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), None),
    (json.dumps({"prompt": [1, 2, 10**6]}).encode(), "prompt"),
    (json.dumps({"prompt": "x" * 5000}).encode(), "prompt"),
    (json.dumps({"max_tokens": 3}).encode(), None),
])
def test_bad_requests_get_openai_errors(cluster, body, param):
    resp = httpx2.post(f"{cluster.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_prefill_killed_requests_recompute_with_identical_output(tiny_model_dir, tmp_path):
    deadline_s = 2.0
    heartbeat_ttl_s = 2.0
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.UCX, block_size=BS, num_blocks=256,
                       kv_deadline_s=deadline_s, heartbeat_ttl_s=heartbeat_ttl_s, log_dir=tmp_path / "logs",
                       launch=FORK)
    prompts = [PROMPTS[3], PROMPTS[4]]
    expected = generate(tiny_model_dir, prompts, SamplingParams(max_tokens=8, temperature=0.0), block_size=BS)
    with LocalCluster(spec) as cluster:
        cluster.stop_process("prefill", signal.SIGKILL)  # still registered until its heartbeat expires
        start = time.monotonic()
        results = complete_all(cluster.url, prompts, max_tokens=8)
        elapsed = time.monotonic() - start
        for want, got in zip(expected, results):
            assert got["choices"][0]["token_ids"] == want
            assert got["kvwire"]["bypassed"] is False
            # and says why: the dead producer's KV never came (its entry never READY, or its restart seen)
            assert got["kvwire"]["transfer_failure"] in {"deadline", "producer"}, got["kvwire"]
        assert elapsed < deadline_s + 8.0  # the deadline plus recompute, not a hang
        # failed transfers stay marked FAILED until their TTL, so a late producer lets go at once
        pools, _ = wait_pools_full_and_directory_empty(cluster.redis_url, expect_empty=False)
        assert pools.get("decode-0") == (256, 256)
        # once the dead node's registration expires (its TTL, not a sleep) the router sends work to decode alone
        directory = KVDirectory(cluster.redis_url)
        try:
            # `kvwire status` counts them by reason too (the decode node's next heartbeat publishes them)
            failed = lambda: sum(directory.get_node("decode-0").recomputed.values())  # noqa: E731
            counted_by = time.monotonic() + 2 * heartbeat_ttl_s
            while failed() < len(prompts):
                assert time.monotonic() < counted_by, directory.get_node("decode-0")
                time.sleep(0.1)
            gone_by = time.monotonic() + 2 * heartbeat_ttl_s
            while directory.live_nodes(NodeRole.PREFILL, include_draining=True):
                assert time.monotonic() < gone_by, "the killed prefill node is still registered"
                time.sleep(0.1)
        finally:
            directory.close()
        start = time.monotonic()
        got = complete(cluster.url, prompts[0], max_tokens=8)
        assert got["choices"][0]["token_ids"] == expected[0] and got["kvwire"]["bypassed"] is False
        assert (got["kvwire"]["path"], got["kvwire"]["reason"]) == ("decode-only", "no-prefill-instance")
        assert got["kvwire"]["transfer_failure"] is None  # none was asked for: no transfer failed
        assert time.monotonic() - start < deadline_s


def test_nodes_reject_malformed_work_and_keep_serving(cluster):
    import msgspec
    import zmq

    from kvwire.connectors.directory.directory import KVDirectory
    from kvwire.connectors.wire import WIRE_VERSION, encode
    from kvwire.protocol.work import PrefillWork

    directory = KVDirectory(cluster.redis_url)
    nodes = directory.live_nodes()
    directory.close()
    junk = [b"", b"\x00" * 100, b"\x93\x01", msgspec.msgpack.encode([WIRE_VERSION + 7, {"type": "prefill"}]),
            msgspec.msgpack.encode([WIRE_VERSION, {"type": "prefill", "request_id": 5}]),
            encode(PrefillWork(request_id="bad-empty", prompt_token_ids=[])),
            encode(PrefillWork(request_id="bad-vocab", prompt_token_ids=[10**6]))]
    ctx = zmq.Context.instance()
    for node in nodes:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(node.work_endpoint)
        for j in junk:
            sock.send(j)
        sock.close()
    got = complete(cluster.url, "still serving", max_tokens=4)
    assert got["kvwire"]["bypassed"] is True
    assert all(p.poll() is None for p in cluster.procs.values())


def test_transport_is_reported_in_response_and_directory(cluster):
    from kvwire.connectors.directory.directory import KVDirectory

    directory = KVDirectory(cluster.redis_url)
    before = directory.transfers("decode-0").get("ucx:count", 0)
    got = complete(cluster.url, "which wire?", max_tokens=2)
    assert got["kvwire"]["transport"] == "ucx"
    deadline = time.monotonic() + 5  # the producer records the delivery off the first token's way, a little later
    while (after := directory.transfers("decode-0")).get("ucx:count", 0) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    directory.close()
    assert after["ucx:count"] == before + 1 and after["ucx:bytes"] >= got["kvwire"]["kv_bytes"]
