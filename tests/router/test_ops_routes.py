"""The router's /readyz and /metrics, in process against a real directory."""

from __future__ import annotations

import msgspec
import pytest
from fastapi.testclient import TestClient

from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.observability.metrics import Metrics
from kvwire.router.app import create_app
from kvwire.router.config import RouterConfig
from tests.connectors.directory.test_directory import node


@pytest.fixture
def client(tiny_model_dir, redis_url):
    metrics = Metrics()
    with TestClient(create_app(RouterConfig(model_dir=tiny_model_dir, redis_url=redis_url), metrics)) as c:
        yield c


def test_readyz_needs_a_live_decode_node(client, redis_url):
    resp = client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json() == {"ready": False, "disaggregate": False, "decode_nodes": 0, "prefill_nodes": 0}
    directory = KVDirectory(redis_url)
    try:
        directory.register_node(node("prefill-0", NodeRole.PREFILL))
        assert client.get("/readyz").status_code == 503  # nothing can be served without a decode node
        directory.register_node(node("decode-0", NodeRole.DECODE))
        resp = client.get("/readyz")
        assert resp.status_code == 200
        assert resp.json() == {"ready": True, "disaggregate": True, "decode_nodes": 1, "prefill_nodes": 1}
    finally:
        directory.close()


def test_readyz_says_whether_it_can_disaggregate_as_prefill_nodes_come_and_go(client, redis_url):
    """Decode nodes alone serve (decode-only): ready, 200, but `disaggregate` false until a prefill node is live,
    and false again once the last one drains or leaves."""
    directory = KVDirectory(redis_url)
    try:
        directory.register_node(node("decode-0", NodeRole.DECODE))
        resp = client.get("/readyz")
        assert (resp.status_code, resp.json()["ready"], resp.json()["disaggregate"]) == (200, True, False)
        directory.register_node(node("prefill-0", NodeRole.PREFILL))
        resp = client.get("/readyz")
        assert (resp.status_code, resp.json()["disaggregate"], resp.json()["prefill_nodes"]) == (200, True, 1)
        directory.register_node(msgspec.structs.replace(node("prefill-0", NodeRole.PREFILL), draining=True))
        assert client.get("/readyz").json()["disaggregate"] is False  # a draining node takes no new work
        directory.register_node(node("prefill-0", NodeRole.PREFILL))
        assert client.get("/readyz").json()["disaggregate"] is True
        directory.deregister_node("prefill-0")
        resp = client.get("/readyz")
        assert (resp.status_code, resp.json()["disaggregate"], resp.json()["prefill_nodes"]) == (200, False, 0)
    finally:
        directory.close()


def test_readyz_is_503_without_the_directory(tiny_model_dir):
    config = RouterConfig(model_dir=tiny_model_dir, redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(config, Metrics())) as c:
        resp = c.get("/readyz")
    assert resp.status_code == 503 and "127.0.0.1:1" in resp.json()["reason"]
    assert resp.json()["disaggregate"] is False


def test_metrics_count_answers_by_status(client):
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 503  # no nodes
    text = client.get("/metrics").text
    assert 'kvwire_requests_total{status="invalid"} 1.0' in text
    assert 'kvwire_requests_total{status="unavailable"} 1.0' in text
    assert 'kvwire_requests_total{status="ok"} 0.0' in text


def test_readyz_cannot_disaggregate_over_nodes_of_two_checkpoints(client, redis_url):
    directory = KVDirectory(redis_url)
    try:
        directory.register_node(msgspec.structs.replace(node("decode-0", NodeRole.DECODE), model="bbbb"))
        directory.register_node(msgspec.structs.replace(node("prefill-0", NodeRole.PREFILL), model="aaaa"))
        body = client.get("/readyz").json()
        assert (body["ready"], body["disaggregate"]) == (True, False) and "checkpoint" in body["reason"]
        directory.register_node(msgspec.structs.replace(node("prefill-1", NodeRole.PREFILL), model="bbbb"))
        body = client.get("/readyz").json()
        assert (body["disaggregate"], body["prefill_nodes"]) == (True, 2) and "reason" not in body
    finally:
        directory.close()
