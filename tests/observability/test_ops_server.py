"""The nodes' /healthz, /readyz and /metrics endpoint, in process."""

from __future__ import annotations

import socket
import threading

import httpx2
import pytest

from kvwire.observability.metrics import Metrics
from kvwire.observability.ops_server import OpsServer


@pytest.fixture
def ops():
    m = Metrics()
    m.requests.labels("ok").inc(3)
    with OpsServer("127.0.0.1", 0, m) as server:
        yield server


def _get(ops: OpsServer, path: str) -> httpx2.Response:
    return httpx2.get(f"http://127.0.0.1:{ops.port}{path}", timeout=5)


def test_healthz_answers_at_once_and_readyz_waits_for_the_check(ops):
    assert _get(ops, "/healthz").status_code == 200
    assert _get(ops, "/readyz").status_code == 503
    ops.set_ready_check(lambda: True)
    assert _get(ops, "/readyz").status_code == 200


def test_readyz_body_says_ready_then_the_details(ops):
    assert _get(ops, "/readyz").text == "not ready\n"
    ops.set_ready_check(lambda: True, lambda: ["transport ucx: ok in 3.0 ms over sysv/cma"])
    resp = _get(ops, "/readyz")
    assert (resp.status_code, resp.text) == (200, "ready\ntransport ucx: ok in 3.0 ms over sysv/cma\n")
    ops.set_ready_check(lambda: False, lambda: ["transport tcp: self-test FAILED after 9.0 ms: refused"])
    resp = _get(ops, "/readyz")
    assert (resp.status_code, resp.text) == (503, "not ready\ntransport tcp: self-test FAILED after 9.0 ms: refused\n")


def test_a_failing_ready_check_is_not_ready(ops):
    def boom() -> bool:
        raise ConnectionError("redis down")

    ops.set_ready_check(boom)
    assert _get(ops, "/readyz").status_code == 503


def test_metrics_in_prometheus_text_format(ops):
    resp = _get(ops, "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert 'kvwire_requests_total{status="ok"} 3.0' in resp.text
    assert _get(ops, "/nope").status_code == 404


def test_port_none_serves_nothing():
    with OpsServer("127.0.0.1", None, Metrics()) as server:
        assert server.port is None


def test_a_port_held_for_a_moment_is_waited_for_and_one_held_for_good_is_an_error():
    """Another process's check of a port (cluster/ports.py binds it once) can hold it as a node starts: the ops
    endpoint waits for it, within its patience; a port someone keeps listening on fails start-up."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    freed = threading.Timer(0.3, holder.close)
    freed.start()
    with OpsServer("127.0.0.1", port, Metrics()) as served:  # bound once the holder let go
        assert served.port == port and httpx2.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    kept = socket.socket()
    kept.bind(("127.0.0.1", 0))
    kept.listen()
    try:
        with pytest.raises(OSError):
            OpsServer("127.0.0.1", kept.getsockname()[1], Metrics())._bind(patience_s=0.2)
    finally:
        kept.close()
