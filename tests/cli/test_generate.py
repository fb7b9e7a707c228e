"""`kvwire generate`: its answers, and the errors a user meets (nothing listening, a refusal), each in one line.

The server here is a stand-in for the router's completions API (the router's own tests cover the router)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from kvwire.cli.main import app
from kvwire.cluster.ports import free_port

KVWIRE = {"bypassed": True, "transport": "shm"}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body["prompt"] == "refuse":
            self._send(400, "application/json", json.dumps({"error": {"message": "prompt too long"}}).encode())
        elif body["prompt"] == "broken":
            self._send(502, "text/plain", b"bad gateway")
        elif body["prompt"] == "vllm":  # the router in front of vLLM servers: vLLM's body, kvwire's headers
            sse = b'data: {"choices": [{"text": "Hel"}]}\n\ndata: {"choices": [{"text": "lo"}]}\n\ndata: [DONE]\n\n'
            whole = json.dumps({"choices": [{"text": "Hello"}]}).encode()
            headers = {"x-kvwire-path": "disaggregated", "x-kvwire-reason": "prefilled"}
            self._send(200, "text/event-stream" if body["stream"] else "application/json",
                       sse if body["stream"] else whole, headers)
        elif body["stream"]:
            chunks = [{"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo"}], "kvwire": KVWIRE}]
            self._send(200, "text/event-stream",
                       b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n")
        else:
            self._send(200, "application/json", json.dumps({"choices": [{"text": "Hello"}], "kvwire": KVWIRE}).encode())

    def _send(self, status: int, kind: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["whole", "stream"])
def test_the_text_and_the_transfer_are_printed(url, stream):
    result = CliRunner().invoke(app, ["generate", "hi", "--url", url, *stream])
    assert result.exit_code == 0, result.output
    assert "Hello" in result.stdout and '"bypassed": true' in result.stderr


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["whole", "stream"])
@pytest.mark.parametrize(("prompt", "line"), [("refuse", "error 400: prompt too long"),
                                              ("broken", "error 502: bad gateway")])
def test_a_refusal_is_one_line(url, stream, prompt, line):
    result = CliRunner().invoke(app, ["generate", prompt, "--url", url, *stream])
    assert result.exit_code == 1 and result.stderr.strip() == line


def test_nothing_listening_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["generate", "hi", "--url", url])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"kvwire generate: {url}: ConnectError")
