"""`kvwire bench vllm --plain-url`: the server there is measured as the baseline only if it serves --model."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvwire.bench.vllm.run import BenchError, check_plain_server


class _Models(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.path == "/v1/models"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(self.body if ok else b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def serving(request) -> Iterator[str]:
    """An HTTP server whose GET /v1/models answers `request.param` (raw bytes), as vLLM's does."""
    handler = type("Handler", (_Models,), {"body": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


MODELS = json.dumps({"object": "list", "data": [{"id": "/models/tiny", "object": "model"}]}).encode()


@pytest.mark.parametrize("serving", [MODELS], indirect=True)
def test_a_server_of_the_model_is_taken(serving: str):
    check_plain_server(serving, "/models/tiny")


@pytest.mark.parametrize("serving", [MODELS], indirect=True)
def test_a_server_of_another_model_is_refused_by_name(serving: str):
    with pytest.raises(BenchError, match=r"serves \['/models/tiny'\], not '/models/other'"):
        check_plain_server(serving, "/models/other")


@pytest.mark.parametrize("serving", [b"<html>not vLLM</html>"], indirect=True)
def test_a_server_that_is_not_vllm_is_refused(serving: str):
    with pytest.raises(BenchError, match="did not list its models"):
        check_plain_server(serving, "/models/tiny")


def test_nothing_listening_is_refused():
    with pytest.raises(BenchError, match="did not list its models"):
        check_plain_server("http://127.0.0.1:1", "/models/tiny")
