"""A real OTLP/HTTP trace receiver for tests: an HTTP server on loopback that keeps every span posted to it.

Spans are decoded with OpenTelemetry's own protobuf messages (opentelemetry-proto, which the `otel` extra's
exporter installs). `endpoint` is what a process is given as its OTLP traces endpoint.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.trace_service_pb2"


def otel_missing() -> str:
    """Why spans cannot be made and read here ("": they can): the otel extra's SDK and protobufs."""
    for module in ("opentelemetry.sdk", "opentelemetry.proto"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'kvwire[otel]')"
    return ""


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # its resource's service.name
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # 16 hex, "" for a root
    attributes: dict
    start_ns: int
    end_ns: int
    error: bool


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _spans(body: bytes) -> list[ReceivedSpan]:
    request = importlib.import_module(TRACE_SERVICE).ExportTraceServiceRequest.FromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                out.append(ReceivedSpan(str(resource.get("service.name", "")), s.name, s.trace_id.hex(),
                                        s.span_id.hex(), s.parent_span_id.hex(),
                                        {a.key: _value(a.value) for a in s.attributes}, s.start_time_unix_nano,
                                        s.end_time_unix_nano, s.status.code == 2))
    return out


class OTLPReceiver:
    """Collects spans posted to `endpoint` (…/v1/traces); `wait_for` them. Use as a context manager."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                got = _spans(body)
                with receiver._lock:
                    receiver.spans.extend(got)
                reply = importlib.import_module(TRACE_SERVICE).ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float) -> dict[str, ReceivedSpan]:
        """The spans of `trace_id` named `names` (the first of each name), once all have come."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = {s.name: s for s in reversed(self.spans) if s.trace_id == trace_id and s.name in names}
            if set(found) == names or time.monotonic() > deadline:
                return found
            time.sleep(0.05)
