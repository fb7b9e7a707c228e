"""Typer option types shared by the commands, and the builders of each process's config."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvwire.connectors.config import MAX_PULL_LANES, ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.directory import advertise
from kvwire.engine.engine_config import EngineConfig
from kvwire.node.config import NodeConfig

if TYPE_CHECKING:
    from kvwire.cluster.redis_server import LocalRedis

ModelDir = Annotated[Path, typer.Option("--model", help="Hugging Face-format checkpoint directory.",
                                        envvar="KVWIRE_MODEL")]
RedisUrl = Annotated[str, typer.Option("--redis-url", help="Redis URL of the directory (redis:// or rediss://).",
                                       envvar="KVWIRE_REDIS_URL")]
OptionalRedisUrl = Annotated[str | None, typer.Option(
    "--redis-url", help="Use this Redis instead of starting a private one.", envvar="KVWIRE_REDIS_URL")]
Host = Annotated[str, typer.Option("--host", help="Address to bind; loopback unless told otherwise.")]
AdvertiseHost = Annotated[str | None, typer.Option(
    "--advertise-host", envvar="KVWIRE_ADVERTISE_HOST",
    help="Address peers reach this node at, published in the directory. Default: --host, or for a wildcard "
         "--host (0.0.0.0) the address of the interface that routes to the directory's Redis (never loopback).")]
Connector = Annotated[ConnectorKind, typer.Option(
    "--connector", help="KV transport: auto (shared memory on one host, UCX across hosts), ucx, shm, nccl or tcp.")]
BlockSize = Annotated[int, typer.Option("--block-size", min=1, help="Tokens per KV block.")]
NumBlocks = Annotated[int, typer.Option("--num-blocks", min=1, help="KV blocks in the pool.")]
KVDeadline = Annotated[float, typer.Option("--kv-deadline", min=0.01,
                                           help="Seconds a decode node waits for KV before recomputing.")]
HttpPort = Annotated[int, typer.Option("--http-port", min=0, max=65535,
                                        help="Serve GET /healthz, /readyz and /metrics on this port; 0: off.")]
LogLevel = Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.")]
TracesEndpoint = Annotated[str, typer.Option(
    "--otlp-traces-endpoint", envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    help="Export kvwire's OpenTelemetry spans (routing, prefill, decode with the transfer's bytes and duration) "
         "to this OTLP/HTTP endpoint, e.g. http://collector:4318/v1/traces; needs `pip install 'kvwire[otel]'`. "
         "Client trace headers are passed on and logged either way.")]
DrainTimeout = Annotated[float, typer.Option(
    "--drain-timeout", min=0, envvar="KVWIRE_DRAIN_TIMEOUT",
    help="On SIGTERM, seconds to finish what the node holds (it takes no new work) before it exits.")]
HeartbeatTTL = Annotated[float, typer.Option(
    "--heartbeat-ttl", min=0.5, envvar="KVWIRE_HEARTBEAT_TTL",
    help="Seconds the node's directory registration lives without a heartbeat (it beats every third of it): "
         "how soon routers stop picking a node that died, and decode nodes give up on its KV. The same on every "
         "node of a cluster.")]
RedisTimeout = Annotated[float, typer.Option(
    "--redis-timeout", min=0.1, envvar="KVWIRE_REDIS_TIMEOUT",
    help="Seconds one Redis command may wait on a silent Redis before it fails (a heartbeat retries at its next "
         "beat; a request's KV wait goes on until its deadline, then recomputes).")]
DirectoryWait = Annotated[float, typer.Option(
    "--directory-wait", min=0, envvar="KVWIRE_DIRECTORY_WAIT",
    help="Seconds a starting node waits for Redis to answer (started beside it, or restarting) before it exits; "
         "it waits with its model loaded, not ready.")]
VerifyKV = Annotated[bool, typer.Option(
    "--verify-kv", help="Prefill: publish a crc32 per layer with each request's KV; decode: require and check them, "
                        "recomputing on a mismatch. Costs a read of every KV byte on each side.")]
PullLanes = Annotated[int, typer.Option(
    "--pull-lanes", min=1, max=MAX_PULL_LANES,
    help="Decode: threads that move one request's KV in parallel (UCX workers, shared-memory copies; host "
         "pools). 1: the engine thread alone.")]
Layerwise = Annotated[bool, typer.Option(
    "--layerwise", help="Prefill: publish each prompt's KV before its forward and send it layer by layer as the "
                        "layers are computed, so the transfer hides behind compute (tcp and ucx connectors).")]
RequireFastPath = Annotated[bool, typer.Option(
    "--require-fast-path", envvar="KVWIRE_REQUIRE_FAST_PATH",
    help="Decode: refuse KV from a producer on this host whose path crosses the network stack (e.g. UCX on tcp "
         "between containers) where shared memory was expected, and recompute; off: warn once per producer.")]
Warmup = Annotated[bool, typer.Option(
    "--warmup/--no-warmup",
    help="Before registering, run a dummy prompt, decode steps and the transfer plane's block copies once on the "
         "node's device, so the first requests do not pay its start-up (CUDA's, on a GPU).")]
AuthSecretFile = Annotated[Path | None, typer.Option(
    "--auth-secret-file", envvar="KVWIRE_AUTH_SECRET_FILE",
    help="File holding a shared secret (16+ bytes): control messages between the router and nodes are sealed "
         "with HMAC-SHA256 and unsealed ones dropped. Every process of a cluster needs the same one.")]


def auth_secret(path: Path | None) -> bytes | None:
    """The secret in `path` (None: authentication off). Raises typer.BadParameter."""
    if path is None:
        return None
    from kvwire.connectors.control.auth import read_secret_file

    try:
        return read_secret_file(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--auth-secret-file") from None


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")


def traces_endpoint(value: str) -> str:
    """--otlp-traces-endpoint, checked: refused where the otel extra is missing (the spans could not be made)."""
    if value and not _importable("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        raise typer.BadParameter("kvwire's spans need the OpenTelemetry SDK: pip install 'kvwire[otel]' (or unset "
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)", param_hint="--otlp-traces-endpoint")
    if value and not value.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{value!r} is not an http(s) URL (OTLP/HTTP)", param_hint="--otlp-traces-endpoint")
    return value


def _importable(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:  # a parent package is missing
        return False


def default_node_id(role: NodeRole) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def check_device(device: str) -> None:
    """Refuse a device this machine does not have before anything starts."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from exc
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise typer.BadParameter(f"no CUDA device {device} on this machine (found {found})", param_hint="--device")
    if dev.type not in ("cpu", "cuda"):
        raise typer.BadParameter(f"kvwire's nodes run on cpu or cuda, not {dev.type}", param_hint="--device")


def node_config(role: NodeRole, *, model: Path, redis_url: str, host: str, port: int, node_id: str | None,
                connector: ConnectorKind, block_size: int, num_blocks: int, kv_deadline: float,
                max_model_len: int, device: str, torch_threads: int, http_port: int = 0,
                auth_secret_file: Path | None = None, verify_kv: bool = False,
                drain_timeout: float = 30.0, pull_lanes: int = 2, layerwise: bool = False,
                advertise_host: str | None = None, require_fast_path: bool = False,
                heartbeat_ttl: float = 5.0, redis_timeout: float = 5.0, directory_wait: float = 60.0,
                prefix_cache: bool = False, warmup: bool = True, otlp_traces_endpoint: str = "") -> NodeConfig:
    """Build a node's one config object from its command-line options."""
    check_device(device)
    if not (model / "config.json").is_file():
        raise typer.BadParameter(f"{model} has no config.json (create one with `kvwire init-model`)",
                                 param_hint="--model")
    try:
        advertised = advertise.advertise_host(host, advertise_host, redis_url)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--advertise-host") from None
    try:
        connector_config = ConnectorConfig(
            kind=connector, role=role, node_id=node_id or default_node_id(role), redis_url=redis_url, host=host,
            advertise_host=advertised,
            kv_deadline_s=kv_deadline, entry_ttl_s=max(60.0, kv_deadline * 2), verify_kv=verify_kv,
            pull_lanes=pull_lanes, layerwise=layerwise, require_fast_path=require_fast_path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return NodeConfig(
        engine=EngineConfig(model_dir=model, block_size=block_size, num_blocks=num_blocks,
                            max_model_len=max_model_len, device=device, torch_threads=torch_threads,
                            prefix_cache=prefix_cache),
        connector=connector_config,
        work_port=port, http_port=http_port, auth_secret=auth_secret(auth_secret_file),
        drain_timeout_s=drain_timeout, heartbeat_ttl_s=heartbeat_ttl, redis_timeout_s=redis_timeout,
        directory_wait_s=directory_wait, warmup=warmup,
        traces_endpoint=traces_endpoint(otlp_traces_endpoint))


ServedModelName = Annotated[str | None, typer.Option(
    "--served-model-name", envvar="KVWIRE_SERVED_MODEL_NAME",
    help="Names a request's `model` may give, comma-separated; answers name the first. Default: the "
         "checkpoint directory's name (its path as given is accepted too). Any other name gets a 404.")]
Lenient = Annotated[bool, typer.Option(
    "--lenient", help="Drop request fields kvwire does not know, with a warning, instead of answering 400 (for "
                      "clients that send extras).")]


def served_model_names(value: str | None) -> tuple[str, ...]:
    """--served-model-name's names. Raises typer.BadParameter for an empty one."""
    if value is None:
        return ()
    names = tuple(n.strip() for n in value.split(","))
    if not all(names):
        raise typer.BadParameter("names must not be empty", param_hint="--served-model-name")
    return names


def refuse_given(ctx: typer.Context, names: tuple[str, ...], why: str) -> None:
    """Raises: typer.BadParameter naming those of `names` given on the command line, `why` they do not apply."""
    # typer bundles its own click: its ParameterSource is not click's, so compare by name
    given = [name for name in names if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"]
    if given:
        raise typer.BadParameter(f"{', '.join('--' + name.replace('_', '-') for name in given)}: {why}")


def csv_of(value: str, kind: type) -> list:
    try:
        return [kind(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def redis_url_of(redis_url: str | None, local: LocalRedis | None) -> str:
    """--redis-url, or the private server's URL when none was given."""
    if redis_url:
        return redis_url
    assert local is not None  # started because no --redis-url was given
    return local.url
