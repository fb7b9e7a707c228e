"""`kvwire router`: the OpenAI-compatible HTTP front door, to kvwire's own nodes or to vLLM servers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from kvwire.cli.options import (
    AuthSecretFile,
    Host,
    Lenient,
    LogLevel,
    ServedModelName,
    TracesEndpoint,
    auth_secret,
    refuse_given,
    served_model_names,
    setup_logging,
    traces_endpoint,
)
from kvwire.router.body_limit import MAX_BODY_BYTES
from kvwire.router.config import RouterConfig, RoutingPolicy, VLLMRouterConfig

NodesModelDir = Annotated[Path | None, typer.Option(
    "--model", help="Hugging Face-format checkpoint directory (kvwire's nodes).", envvar="KVWIRE_MODEL")]
NodesRedisUrl = Annotated[str | None, typer.Option(
    "--redis-url", help="Redis URL of the directory (kvwire's nodes).", envvar="KVWIRE_REDIS_URL")]
VLLMPrefill = Annotated[str | None, typer.Option(
    "--vllm-prefill", envvar="KVWIRE_VLLM_PREFILL",
    help="Front vLLM servers: base URLs (no /v1) of the prefill instances, comma-separated. Needs --vllm-decode.")]
VLLMDecode = Annotated[str | None, typer.Option(
    "--vllm-decode", envvar="KVWIRE_VLLM_DECODE",
    help="Front vLLM servers: base URLs of the decode instances, comma-separated. Alone: every request decode-only.")]
HealthInterval = Annotated[float, typer.Option(
    "--health-interval", min=0.1, help="vLLM mode: seconds between GET /health probes of each instance.")]
ConnectTimeout = Annotated[float, typer.Option(
    "--connect-timeout", min=0.1, help="vLLM mode: seconds to connect to an instance before trying again (the "
                                       "instance counts as busy, not gone).")]
InstanceWait = Annotated[float, typer.Option(
    "--instance-wait", min=0.0, help="vLLM mode: seconds a request may wait for a decode instance to take it "
                                     "(none up, or none accepting connections) before it gets a 503.")]
MaxFailures = Annotated[int, typer.Option(
    "--max-failures", min=1, help="vLLM mode: broken calls or 5xx answers in a row that take an instance out of "
                                  "rotation (a refused connection takes it out at once).")]
UnresponsiveAfter = Annotated[float, typer.Option(
    "--unresponsive-after", min=0.1, help="vLLM mode: seconds an instance may answer nothing (only timeouts) "
                                          "before it leaves rotation; until then it is weighed as loaded.")]
Sequential = Annotated[bool, typer.Option(
    "--sequential", help="vLLM mode: send a request to its decode instance only once the prefill instance has "
                         "answered. By default, once a prefill instance's answers show kvwire's connector, both get "
                         "it at once and the decode instance waits for the KV.")]
PrefillMaxInFlight = Annotated[int, typer.Option(
    "--prefill-max-in-flight", min=0, help="Send a request decode-only when every prefill instance up (node live) has "
                                           "this many requests of the router in flight (0: no limit). With kvwire's "
                                           "own nodes a request is in flight there until its first token.")]
Routing = Annotated[RoutingPolicy, typer.Option(
    "--routing", help="prefix: each request to the decode instance (or node) whose prefix cache holds the most of its "
                      "prompt (predicted from where the router sent earlier prompts and what they answered), weighed "
                      "against load; load: by load alone.")]
DecodeOnlyBelow = Annotated[int | None, typer.Option(
    "--decode-only-below", min=0, show_default=False,
    help="Send a request decode-only when the part of its prompt the decode instance picked does not hold is "
         "shorter than this many tokens (0: always disaggregate). vLLM mode: default 512. kvwire's own nodes: "
         "default 0, every prompt disaggregated.")]
PrefixTTL = Annotated[float, typer.Option(
    "--prefix-ttl", min=0.1, help="Seconds an instance (or node) is taken to hold a prompt's KV blocks after it was "
                                  "last sent them or answered them.")]
VLLMKVEvents = Annotated[str | None, typer.Option(
    "--vllm-kv-events", help="vLLM mode: the ZMQ endpoints of the decode instances' KV event publishers (vLLM's "
                             "--kv-events-config with a binding endpoint such as tcp://*:5557), comma-separated in "
                             "--vllm-decode's order, empty for one without, e.g. tcp://10.0.0.5:5557,: the router "
                             "connects, and those instances' prefix caches are known, not predicted.")]
Port = Annotated[int, typer.Option("--port", min=1, max=65535, help="HTTP port.")]
RequestTimeout = Annotated[float, typer.Option(
    "--request-timeout", min=0.1, help="Seconds before a request gets a 504 (vLLM mode: between the bytes of an "
                                       "instance's answer).")]
MaxBodyBytes = Annotated[int, typer.Option(
    "--max-body-bytes", min=1, help="A request body over this many bytes gets a 413 naming this cap before it is read "
                                    "(a stated length at once; a chunked body at the first byte past it).")]
_KVWIRE_ONLY = ("model", "redis_url", "auth_secret_file", "served_model_name", "lenient", "otlp_traces_endpoint")
_VLLM_ONLY = ("health_interval", "connect_timeout", "instance_wait", "max_failures", "unresponsive_after", "sequential",
              "vllm_kv_events")


def router(ctx: typer.Context, model: NodesModelDir = None, redis_url: NodesRedisUrl = None,
           vllm_prefill: VLLMPrefill = None, vllm_decode: VLLMDecode = None, host: Host = "127.0.0.1",
           port: Port = 8000, request_timeout: RequestTimeout = 120.0, health_interval: HealthInterval = 2.0,
           connect_timeout: ConnectTimeout = 2.0, instance_wait: InstanceWait = 30.0,
           max_failures: MaxFailures = 3, unresponsive_after: UnresponsiveAfter = 30.0, sequential: Sequential = False,
           prefill_max_in_flight: PrefillMaxInFlight = 0, routing: Routing = RoutingPolicy.PREFIX,
           decode_only_below: DecodeOnlyBelow = None, prefix_ttl: PrefixTTL = 120.0,
           vllm_kv_events: VLLMKVEvents = None, auth_secret_file: AuthSecretFile = None,
           served_model_name: ServedModelName = None, lenient: Lenient = False,
           max_body_bytes: MaxBodyBytes = MAX_BODY_BYTES, otlp_traces_endpoint: TracesEndpoint = "",
           log_level: LogLevel = "INFO") -> None:
    """Serve the OpenAI API (POST /v1/completions, /v1/chat/completions, /v1/responses), Anthropic's
    /v1/messages, GET /v1/models, /healthz, /readyz and /metrics: over kvwire's nodes (--model,
    --redis-url), or over vLLM servers (--vllm-decode, and --vllm-prefill to disaggregate; then also POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter, passed on to every server)."""
    import uvicorn

    setup_logging(log_level)
    if vllm_prefill is not None or vllm_decode is not None:
        if log_level.upper() != "DEBUG":  # httpx2 logs every call at INFO, health probes included
            logging.getLogger("httpx2").setLevel(logging.WARNING)
        timing = VLLMTiming(request_timeout, connect_timeout, health_interval, instance_wait, max_failures,
                            unresponsive_after, sequential, prefill_max_in_flight, routing,
                            VLLMRouterConfig.decode_only_below if decode_only_below is None else decode_only_below,
                            prefix_ttl, tuple(e.strip() for e in vllm_kv_events.split(",")) if vllm_kv_events else ())
        app = _vllm_app(ctx, vllm_prefill, vllm_decode, host, port, timing, max_body_bytes)
        if otlp_traces_endpoint:  # from the environment (on the command line it is refused)
            logging.getLogger(__name__).info(
                "the vLLM router makes no spans of its own (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is for kvwire's nodes);"
                " it passes traceparent/tracestate on to the vLLM servers, which export theirs")
    else:
        paths = NodesPaths(decode_only_below or 0, prefill_max_in_flight, routing, prefix_ttl,
                           traces_endpoint(otlp_traces_endpoint))
        app = _kvwire_app(ctx, model, redis_url, host, port, request_timeout, auth_secret_file,
                          served_model_names(served_model_name), lenient, paths, max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), access_log=False)


class NodesPaths(NamedTuple):
    """kvwire's own nodes: where the router sends a request and when decode-only, as given (RouterConfig)."""

    decode_only_below: int
    prefill_max_in_flight: int
    routing: RoutingPolicy
    prefix_ttl: float
    traces_endpoint: str


def _kvwire_app(ctx: typer.Context, model: Path | None, redis_url: str | None, host: str, port: int,
                request_timeout: float, auth_secret_file: Path | None, names: tuple[str, ...], lenient: bool,
                paths: NodesPaths, max_body_bytes: int):
    from kvwire.connectors.control import auth
    from kvwire.engine.gc_pauses import freeze_startup_heap
    from kvwire.router.app import create_app

    if model is None:
        raise typer.BadParameter("needed unless --vllm-decode fronts vLLM servers", param_hint="--model")
    refuse_given(ctx, _VLLM_ONLY, "for vLLM servers (--vllm-decode), not with kvwire's own nodes")
    if redis_url is None:
        raise typer.BadParameter("needed unless --vllm-decode fronts vLLM servers", param_hint="--redis-url")
    config = RouterConfig(model_dir=model, redis_url=redis_url, host=host, port=port, request_timeout_s=request_timeout,
                          served_model_names=names, lenient=lenient, auth_secret=auth_secret(auth_secret_file),
                          decode_only_below=paths.decode_only_below, prefill_max_in_flight=paths.prefill_max_in_flight,
                          routing=paths.routing, prefix_ttl_s=paths.prefix_ttl, max_body_bytes=max_body_bytes,
                          traces_endpoint=paths.traces_endpoint)
    auth.install(config.auth_secret)  # before any socket opens
    app = create_app(config)
    freeze_startup_heap()  # the router's heap holds the tokenizer and the app (no torch: tests/test_lean_install.py)
    return app


class VLLMTiming(NamedTuple):
    """The vLLM mode's flags of timing, tolerance, dispatch and routing, as given."""

    request_timeout: float
    connect_timeout: float
    health_interval: float
    instance_wait: float
    max_failures: int
    unresponsive_after: float
    sequential: bool
    prefill_max_in_flight: int
    routing: RoutingPolicy
    decode_only_below: int
    prefix_ttl: float
    kv_events: tuple[str, ...]


def _vllm_app(ctx: typer.Context, prefill: str | None, decode: str | None, host: str, port: int, timing: VLLMTiming,
              max_body_bytes: int):
    from kvwire.router.vllm.proxy import create_vllm_app

    refuse_given(ctx, _KVWIRE_ONLY, "for kvwire's own nodes, not with --vllm-prefill/--vllm-decode")
    if decode is None:
        raise typer.BadParameter("--vllm-prefill needs --vllm-decode: a prefill instance does not answer clients",
                                 param_hint="--vllm-decode")
    try:
        config = VLLMRouterConfig(prefill_urls=vllm_urls(prefill or ""), decode_urls=vllm_urls(decode), host=host,
                                  port=port, request_timeout_s=timing.request_timeout,
                                  connect_timeout_s=timing.connect_timeout, health_interval_s=timing.health_interval,
                                  instance_wait_s=timing.instance_wait, max_failures=timing.max_failures,
                                  unresponsive_s=timing.unresponsive_after, sequential=timing.sequential,
                                  prefill_max_in_flight=timing.prefill_max_in_flight, routing=timing.routing,
                                  decode_only_below=timing.decode_only_below, prefix_ttl_s=timing.prefix_ttl,
                                  decode_kv_events=timing.kv_events, max_body_bytes=max_body_bytes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return create_vllm_app(config)


def vllm_urls(option: str) -> tuple[str, ...]:
    """Args: option, comma-separated base URLs. Returns: each one stripped, without a trailing slash."""
    return tuple(url.strip().rstrip("/") for url in option.split(",") if url.strip())
