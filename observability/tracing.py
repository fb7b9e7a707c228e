"""Trace context through kvwire, and its own OpenTelemetry spans (optional: `pip install 'kvwire[otel]'`).

A client's W3C `traceparent` / `tracestate` headers (`TraceContext.from_headers`, checked: a malformed one is
dropped, as the W3C spec says) ride the router's work to the nodes, which log the trace id with the request.

With an OTLP endpoint (`--otlp-traces-endpoint`, or the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), each
process also exports spans over OTLP/HTTP, children of the client's span:

1. `Spans.open(service, endpoint)` at start-up; refused (TracingUnavailable) where the otel extra is missing.
2. The router's `start("kvwire.request", parent)` span covers routing to the last token; its context
   (`SpanHandle.context`) is what the nodes are sent, so theirs are its children.
3. Nodes `record` spans after the fact, with their wall-clock start and end ("kvwire.prefill": work taken to
   KV held; "kvwire.decode": work taken to the last token, with the transfer's bytes and duration).
4. `close()` flushes what is queued.

Without an endpoint every call is a no-op, and the context passed on is the client's, unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

_TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
MAX_TRACESTATE = 512  # W3C: vendors may drop a longer one

Attributes = Mapping[str, str | int | float | bool]


class TraceContext(msgspec.Struct, frozen=True, array_like=True):
    """A W3C trace context as it rides kvwire's work messages (protocol/work.py): checked where it enters."""

    traceparent: str  # version-traceid-parentid-flags, lower-case hex
    tracestate: str = ""


class TracingUnavailable(RuntimeError):
    """An OTLP endpoint was given, and the OpenTelemetry SDK is not installed."""


def trace_context(traceparent: str | None, tracestate: str | None = None) -> TraceContext | None:
    """The client's context, or None for a missing or malformed `traceparent` (a new trace then begins)."""
    if not traceparent or not _TRACEPARENT.match(traceparent.strip().lower()):
        return None
    state = (tracestate or "").strip()
    return TraceContext(traceparent.strip().lower(), state if len(state) <= MAX_TRACESTATE else "")


def checked(trace: TraceContext | None) -> TraceContext | None:
    """A context from a peer's message, checked as a client's header is (peers' bytes are data)."""
    return trace_context(trace.traceparent, trace.tracestate) if trace is not None else None


def trace_id(trace: TraceContext | None) -> str:
    """The 32-hex trace id ("" without a context), for log lines."""
    return trace.traceparent.split("-")[1] if trace is not None else ""


class SpanHandle:
    """A span in progress (the router's); `context` is what its children are sent."""

    def __init__(self, span: Any, context: TraceContext | None):
        self._span = span
        self.context = context

    def end(self, attributes: Attributes | None = None, error: str = "") -> None:
        if self._span is None:
            return
        if attributes:
            self._span.set_attributes(dict(attributes))
        _set_error(self._span, error)
        self._span.end()
        self._span = None


class Spans:
    """A process's span exporter; `Spans()` (no endpoint) records nothing."""

    def __init__(self, provider: Any = None, service: str = ""):
        self._provider = provider
        self._tracer = provider.get_tracer("kvwire") if provider is not None else None
        self.service = service

    @classmethod
    def open(cls, service: str, endpoint: str) -> Spans:
        """Spans exported to `endpoint` (OTLP/HTTP, e.g. http://collector:4318/v1/traces); "": none.

        Raises:
            TracingUnavailable: the endpoint is set and the otel extra is not installed.
        """
        if not endpoint:
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise TracingUnavailable(f"an OTLP traces endpoint is set ({endpoint}), and kvwire's spans need the "
                                     f"OpenTelemetry SDK: pip install 'kvwire[otel]' ({exc})") from None
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider, service)

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, parent: TraceContext | None, attributes: Attributes | None = None) -> SpanHandle:
        """A span beginning now, child of `parent`; ended by the caller (`SpanHandle.end`)."""
        if self._tracer is None:
            return SpanHandle(None, parent)
        span = self._tracer.start_span(name, context=_otel_context(parent), attributes=dict(attributes or {}))
        return SpanHandle(span, _context_of(span, parent))

    def record(self, name: str, parent: TraceContext | None, start_ns: int, end_ns: int,
               attributes: Attributes | None = None, error: str = "") -> None:
        """A span that ran from `start_ns` to `end_ns` (wall clock, time.time_ns()), child of `parent`."""
        if self._tracer is None or parent is None:
            return  # a node spans only requests that came with a trace (the router starts one for every request)
        span = self._tracer.start_span(name, context=_otel_context(parent), attributes=dict(attributes or {}),
                                       start_time=start_ns)
        _set_error(span, error)
        span.end(end_time=end_ns)

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # exports what is queued
            self._provider = self._tracer = None


def _set_error(span: Any, error: str) -> None:
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))


def _otel_context(parent: TraceContext | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if parent is None:
        return None
    carrier = {"traceparent": parent.traceparent}
    if parent.tracestate:
        carrier["tracestate"] = parent.tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def _context_of(span: Any, parent: TraceContext | None) -> TraceContext:
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return TraceContext(carrier["traceparent"], carrier.get("tracestate", parent.tracestate if parent else ""))
