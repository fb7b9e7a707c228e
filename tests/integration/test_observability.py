"""Metrics, readiness and `kvwire status` against a real local cluster (the one `kvwire up` starts), over TCP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import msgspec
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.cluster.status import ClusterStatus, read_status, render
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from tests.integration.cluster import complete_all
from tests.procs import FORK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.TCP, num_blocks=256,
                       log_dir=tmp_path_factory.mktemp("observability-logs"), launch=FORK)
    with LocalCluster(spec) as c:
        results = complete_all(c.url, ["metrics one", [5, 6, 7, 8, 9] * 7], max_tokens=6)
        assert all(r["kvwire"]["bypassed"] for r in results)
        yield c


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of the process's /metrics."""
    resp = httpx2.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def one(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_every_process_is_ready(cluster):
    assert set(cluster.ops_urls) == {"router", "prefill", "decode"}
    for name, url in cluster.ops_urls.items():
        assert httpx2.get(f"{url}/readyz", timeout=10).status_code == 200, name
    for role in ("prefill", "decode"):
        assert httpx2.get(f"{cluster.ops_urls[role]}/healthz", timeout=10).status_code == 200


def test_counters_moved_where_the_events_happened(cluster):
    router, decode, prefill = (scrape(cluster.ops_urls[n]) for n in ("router", "decode", "prefill"))
    assert one(router, "kvwire_requests_total", status="ok") >= 2
    assert one(router, "kvwire_ttft_seconds_count") >= 2
    assert one(decode, "kvwire_kv_transfer_bytes_total", connector="tcp") > 0
    assert one(decode, "kvwire_kv_transfer_seconds_count", connector="tcp") >= 2
    assert one(decode, "kvwire_ttft_seconds_count") >= 2
    assert one(decode, "kvwire_recomputes_total", reason="kv_not_received") == 0
    assert one(decode, "kvwire_directory_op_seconds_count", op="write_node") >= 1  # its registration
    assert one(prefill, "kvwire_directory_op_seconds_count", op="publish_ready") >= 2
    for samples in (decode, prefill):
        used, free = one(samples, "kvwire_kv_blocks", state="used"), one(samples, "kvwire_kv_blocks", state="free")
        assert used >= 0 and free > 0 and used + free == 256
    assert ("kvwire_queue_depth", frozenset({("queue", "decode_running")})) in decode
    assert ("kvwire_queue_depth", frozenset({("queue", "prefill_pending")})) in prefill
    assert one(prefill, "kvwire_queue_depth", queue="prefill_settling") == 0  # no pull failed with sends in flight


def test_status_json_lists_both_nodes_with_a_recent_heartbeat(cluster):
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "status", "--json", "--redis-url",
                           cluster.redis_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    status = msgspec.json.decode(done.stdout, type=ClusterStatus)
    want = {("prefill-0", NodeRole.PREFILL), ("decode-0", NodeRole.DECODE)}
    assert {(n.node_id, n.role) for n in status.nodes} == want
    assert all(n.heartbeat_age_s is not None and n.heartbeat_age_s < 5 for n in status.nodes)
    assert all(n.connector == ConnectorKind.TCP and n.total_blocks == 256 for n in status.nodes)


def test_status_counts_the_decode_nodes_pulls(cluster):
    def decode_pulls() -> tuple[int, dict]:
        status = read_status_of(cluster.redis_url)
        [decode] = [n for n in status.nodes if n.role == NodeRole.DECODE]
        return decode.pulls, decode.recomputed

    by = time.monotonic() + 10  # its next heartbeat publishes them
    while decode_pulls()[0] < 2:
        assert time.monotonic() < by, decode_pulls()
        time.sleep(0.1)
    assert decode_pulls()[1] == {}  # nothing failed
    row = next(line for line in render(read_status_of(cluster.redis_url)).splitlines() if line.startswith("decode-0"))
    [decode] = [n for n in read_status_of(cluster.redis_url).nodes if n.role == NodeRole.DECODE]
    assert row.split()[-3:] == [str(decode_pulls()[0]), "0", decode.model] and len(decode.model) == 16


def read_status_of(redis_url: str) -> ClusterStatus:
    directory = KVDirectory(redis_url)
    try:
        return read_status(directory)
    finally:
        directory.close()


def test_a_real_prometheus_answers_every_panel_and_fires_an_alert(cluster, tmp_path):
    """deploy/observability's dashboard and alerts as an operator's Prometheus runs them, against this cluster.

    Every panel's query returns series, but the vLLM connector's (tests/vllm/test_pd_schedule.py checks those against
    real vLLM servers); every alert's expression evaluates; a prefill node that stops answering (SIGSTOP) fires
    KvwireNodeDown. Last in the module: the prefill node is stopped for a few seconds."""
    from tests.observability.prometheus import DASHBOARD, RULES, Prometheus, draw

    targets = {name: url.removeprefix("http://") for name, url in cluster.ops_urls.items()}
    prometheus = Prometheus(tmp_path, targets)
    try:
        prometheus.wait_ready()
        complete_all(cluster.url, ["scraped once", "scraped twice"], max_tokens=4)
        panels = [(p["title"], t["expr"]) for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
        deadline = time.monotonic() + 30
        empty = panels
        while empty and time.monotonic() < deadline:  # rate() needs two scrapes after the traffic
            complete_all(cluster.url, ["keep the rates up"], max_tokens=2)
            empty = [(title, expr) for title, expr in panels if "vllm:" not in expr and not prometheus.query(expr)]
            time.sleep(1)
        assert not empty, f"panels with no series: {empty}"
        for rule in yaml.safe_load(RULES.read_text())["spec"]["groups"][0]["rules"]:
            prometheus.query(rule["expr"])  # evaluates (HTTP 200), firing or not
        assert prometheus.firing() == {}, "an alert fired on a healthy cluster"
        if picture := os.environ.get("KVWIRE_DASHBOARD_PNG"):  # the picture in docs/observability.md
            draw(prometheus, [p for p in panels if "vllm:" not in p[1]], Path(picture))
        prefill = cluster.procs["prefill"]
        prefill.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while "KvwireNodeDown" not in prometheus.firing() and time.monotonic() < deadline:
                time.sleep(0.5)
            down = prometheus.firing().get("KvwireNodeDown", [])
        finally:
            prefill.send_signal(signal.SIGCONT)
        assert [a["component"] for a in down] == ["prefill"]
    finally:
        prometheus.stop()
