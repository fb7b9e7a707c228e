"""The vLLM-mode router's own answers, in process, with no vLLM instance listening.

Its passage of requests to real vLLM servers is tested in tests/vllm/.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvwire.observability.metrics import Metrics
from kvwire.router.config import VLLMRouterConfig
from kvwire.router.vllm.proxy import create_vllm_app

NOBODY = ("http://127.0.0.1:1", "http://127.0.0.1:2")  # ports nothing listens on: connection refused


@pytest.fixture
def client():
    config = VLLMRouterConfig(prefill_urls=NOBODY[:1], decode_urls=NOBODY[1:], health_interval_s=60.0,
                              instance_wait_s=0.3)
    with TestClient(create_vllm_app(config, Metrics())) as c:
        yield c


def test_no_decode_instance_up_is_503_in_openai_shape(client):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})):
        resp = client.post(path, json=body, headers={"x-request-id": "req-7"})
        assert resp.status_code == 503 and resp.headers["x-request-id"] == "req-7"
        error = resp.json()["error"]
        assert error["type"] == "service_unavailable" and "req-7" in error["message"]
    assert client.get("/v1/models").status_code == 503


def test_a_body_that_is_not_a_json_object_is_400(client):
    resp = client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_healthz_and_readyz_tell_which_instances_are_down(client):
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health.json()["prefill"]["up"] == [] and health.json()["decode"]["down"][0]["url"] == NOBODY[1]
    assert "ConnectError" in health.json()["decode"]["down"][0]["reason"]
    assert client.get("/readyz").json() == {"ready": False, "decode_instances": 0}


def test_metrics_count_answers_and_instances(client):
    client.post("/v1/completions", json={"prompt": "hi"})
    client.post("/v1/completions", content=b"{")
    text = client.get("/metrics").text
    assert 'kvwire_requests_total{status="unavailable"} 1.0' in text
    assert 'kvwire_requests_total{status="invalid"} 1.0' in text
    assert 'kvwire_vllm_instances{role="decode",state="down"} 1.0' in text
    assert 'kvwire_vllm_instances{role="prefill",state="up"} 0.0' in text
    assert 'kvwire_vllm_requests_total{path="decode-only"} 0.0' in text


@pytest.mark.parametrize("prefill, decode, message", [
    ((), (), "at least one vLLM decode"),
    ((), ("localhost:8000",), "not a vLLM base URL"),
    ((), ("http://h:8000/v1",), "without /v1"),
    (("http://p:1", "http://p:1"), ("http://d:1",), "named twice"),
])
def test_config_refuses_what_it_cannot_route_to(prefill, decode, message):
    with pytest.raises(ValueError, match=message):
        VLLMRouterConfig(prefill_urls=prefill, decode_urls=decode)
