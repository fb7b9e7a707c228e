"""A path a router does not serve, or a method a path does not take: OpenAI's error shape, naming what it serves,
for both routers (the official `openai` client reads `error.message`)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvwire.observability.metrics import Metrics
from kvwire.router.app import create_app
from kvwire.router.config import RouterConfig, VLLMRouterConfig
from kvwire.router.vllm.proxy import create_vllm_app


@pytest.fixture(params=["nodes", "vllm"])
def client(request, tiny_model_dir, redis_url):
    if request.param == "nodes":
        app = create_app(RouterConfig(model_dir=tiny_model_dir, redis_url=redis_url), Metrics())
    else:
        app = create_vllm_app(VLLMRouterConfig(prefill_urls=(), decode_urls=("http://127.0.0.1:9",)), Metrics())
    with TestClient(app) as c:
        yield c


def test_an_unknown_path_is_404_naming_the_routes_served(client):
    resp = client.post("/v1/embeddings", json={"input": "hi"})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["type"] == "not_found" and error["code"] == 404
    assert error["message"].startswith("POST /v1/embeddings is not served here; this router serves ")
    assert "POST /v1/chat/completions" in error["message"]


def test_a_method_a_path_does_not_take_is_405_naming_the_routes_served(client):
    resp = client.get("/v1/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["message"].startswith("/v1/completions does not take GET here; this router serves")


def test_vllms_health_path_answers_as_readyz(client):
    """A probe written for a vLLM server (GET /health) finds the router: 503 here, with no decode node or instance."""
    assert client.get("/health").status_code == client.get("/readyz").status_code == 503
