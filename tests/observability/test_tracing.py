"""Trace context as it enters kvwire (checked like any peer's bytes), spans off without an endpoint, and the
--otlp-traces-endpoint option refused where it could not be applied."""

from __future__ import annotations

import importlib.util

import pytest
import typer

from kvwire.cli.options import traces_endpoint
from kvwire.observability.tracing import MAX_TRACESTATE, Spans, TraceContext, checked, trace_context, trace_id

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("header", [
    "", "garbage", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # an all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # an all-zero parent id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the forbidden version
    "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",  # not hex
    GOOD + "-extra",
])
def test_a_malformed_traceparent_is_dropped(header):
    assert trace_context(header, "a=b") is None


def test_a_traceparent_is_kept_lower_case_with_its_state_and_a_long_state_is_dropped():
    got = trace_context(GOOD.upper(), " vendor=1 ")
    assert got == TraceContext(GOOD, "vendor=1") and trace_id(got) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_context(GOOD, "x" * (MAX_TRACESTATE + 1)) == TraceContext(GOOD, "")
    assert trace_id(None) == ""


def test_a_peers_context_is_checked_again():
    assert checked(TraceContext("not-a-traceparent")) is None
    assert checked(TraceContext(GOOD, "s=1")) == TraceContext(GOOD, "s=1")
    assert checked(None) is None


def test_without_an_endpoint_spans_record_nothing_and_pass_the_clients_context_on():
    spans = Spans.open("kvwire-test", "")
    parent = TraceContext(GOOD)
    handle = spans.start("kvwire.route", parent, {"a": 1})
    assert not spans.on and handle.context == parent
    handle.end({"b": 2}, error="x")  # nothing to end: no error either
    spans.record("kvwire.decode", parent, 0, 1)
    spans.close()


def test_the_endpoint_option_is_refused_where_spans_cannot_be_made(monkeypatch):
    assert traces_endpoint("") == ""
    with pytest.raises(typer.BadParameter, match="http"):
        traces_endpoint("collector:4318")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("opentelemetry.sdk")
                        else real(name, *a))
    with pytest.raises(typer.BadParameter, match=r"kvwire\[otel\]"):
        traces_endpoint("http://127.0.0.1:4318/v1/traces")
    with monkeypatch.context() as m:  # a lean install: not even opentelemetry's namespace package
        def no_parent(name, *a):
            if name.startswith("opentelemetry"):
                raise ModuleNotFoundError(name)
            return real(name, *a)

        m.setattr(importlib.util, "find_spec", no_parent)
        with pytest.raises(typer.BadParameter, match=r"kvwire\[otel\]"):
            traces_endpoint("http://127.0.0.1:4318/v1/traces")
