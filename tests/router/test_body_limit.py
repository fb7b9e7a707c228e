"""Both routers refuse a request body over their cap with a 413 that names it, before reading it, and serve on.

The middleware alone (ASGI messages counted), a real `kvwire router` process in vLLM mode sent 64 MiB with a
stated length and a chunked body past its cap, and the own-nodes router's app.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx2
import pytest
from fastapi.testclient import TestClient

from kvwire.cluster.ports import free_port
from kvwire.observability.metrics import Metrics
from kvwire.router.body_limit import BodyLimit
from kvwire.router.config import RouterConfig

CAP = 1 << 20


class _Echo:
    """An app that reads its body whole and answers its length; what it was called with is kept."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.after: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        self.after.append((await receive())["type"])  # what a later receive() gives: the connection's own
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})


def _run(app, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes, int]:
    """(status, body, messages received of the client's): `chunks` as the client's body, then a disconnect."""
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    queue.append({"type": "http.disconnect"})
    taken, sent = [0], []

    async def receive():
        taken[0] += 1
        return queue[taken[0] - 1]

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), taken[0]


def test_a_stated_length_over_the_cap_is_refused_unread():
    echo = _Echo()
    status, body, taken = _run(BodyLimit(echo, CAP), [(b"content-length", str(64 << 20).encode())], [b"x" * 10])
    assert status == 413 and taken == 0 and echo.bodies == []
    assert f"limit of {CAP} bytes" in body.decode() and b"--max-body-bytes" in body


def test_a_chunked_body_is_refused_at_the_first_chunk_past_the_cap():
    echo = _Echo()
    chunks = [b"x" * (CAP // 4)] * 8  # twice the cap; refused at the fifth chunk
    status, _, taken = _run(BodyLimit(echo, CAP), [(b"transfer-encoding", b"chunked")], chunks)
    assert status == 413 and taken == 5 and echo.bodies == []


def test_a_body_within_the_cap_reaches_the_app_whole_and_later_receives_pass_through():
    echo = _Echo()
    status, body, _ = _run(BodyLimit(echo, CAP), [(b"content-length", str(CAP).encode())], [b"a" * (CAP - 1), b"b"])
    assert status == 200 and body == str(CAP).encode() and echo.bodies == [b"a" * (CAP - 1) + b"b"]
    assert echo.after == ["http.disconnect"]


def test_a_request_without_a_body_is_untouched():
    echo = _Echo()
    assert _run(BodyLimit(echo, 1), [], [b""])[0] == 200 and echo.bodies == [b""]


def test_the_vllm_router_process_refuses_64_mib_fast_and_serves_on(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", "router", "--vllm-decode", "http://127.0.0.1:1",
                             "--port", str(port), "--max-body-bytes", str(CAP), "--instance-wait", "0.3"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "router.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc)
        start = time.monotonic()
        big = httpx2.post(f"{url}/v1/completions", content=b"x" * (64 << 20), timeout=30)
        took = time.monotonic() - start
        assert big.status_code == 413 and f"limit of {CAP} bytes" in big.json()["error"]["message"]
        chunked = httpx2.post(f"{url}/v1/completions", content=iter([b"y" * (CAP // 2)] * 4), timeout=30)
        assert chunked.status_code == 413
        after = httpx2.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert after.status_code == 503, "served on: no decode instance is up, so a 503 in OpenAI's shape"
        assert took < 10, f"the refusal took {took:.1f} s"
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the router exited"
        try:
            httpx2.get(f"{url}/healthz", timeout=1)
            return
        except httpx2.TransportError:
            time.sleep(0.1)
    pytest.fail("the router did not answer")


def test_the_own_nodes_router_refuses_over_its_cap(tiny_model_dir, redis_url):
    from kvwire.router.app import create_app

    config = RouterConfig(model_dir=tiny_model_dir, redis_url=redis_url, max_body_bytes=1000)
    with TestClient(create_app(config, Metrics())) as client:
        resp = client.post("/v1/completions", content=b"{" + b" " * 2000 + b"}")
        assert resp.status_code == 413 and "limit of 1000 bytes" in resp.json()["error"]["message"]
        assert client.post("/v1/completions", content=b"{").status_code == 400  # under the cap: read, parsed
