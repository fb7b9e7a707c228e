"""vLLM servers exporting their spans to a test's OTLP/HTTP receiver (tests/observability/otlp.py): a server
started with `traced(spec, receiver.endpoint_for(name))` posts them under `name`.

vLLM (tracing/otel.py) exports one `llm_request` span per finished request from its API server, its parent the
request's `traceparent`/`tracestate` headers; with OTEL_BSP_SCHEDULE_DELAY at 200 ms a span arrives within about a
second of its request's end.
"""

from __future__ import annotations

import dataclasses

from kvwire.cluster.vllm_cluster import VLLMServerSpec

EXPORT_DELAY_MS = 200  # OTEL_BSP_SCHEDULE_DELAY: the SDK's batch processor exports this often (its default: 5 s)


def traced(spec: VLLMServerSpec, endpoint: str) -> VLLMServerSpec:
    """`spec` exporting its spans to `endpoint` over OTLP/HTTP, every EXPORT_DELAY_MS."""
    return dataclasses.replace(
        spec, extra_args=(*spec.extra_args, "--otlp-traces-endpoint", endpoint),
        extra_env=(*spec.extra_env, ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                   ("OTEL_BSP_SCHEDULE_DELAY", str(EXPORT_DELAY_MS))))
