"""`kvwire up`: a whole local cluster in the foreground until Ctrl-C or SIGTERM.

A child that crashes is restarted (cluster/supervisor.py) while the others keep serving; only
Ctrl-C, SIGTERM or `--max-restarts` used up stops everything.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from kvwire.cli.extras import for_cluster, require
from kvwire.cli.options import (
    AuthSecretFile,
    Connector,
    Host,
    KVDeadline,
    Layerwise,
    Lenient,
    LogLevel,
    OptionalRedisUrl,
    ServedModelName,
    TracesEndpoint,
    auth_secret,
    served_model_names,
    setup_logging,
    traces_endpoint,
)
from kvwire.cluster.local_cluster import ClusterError, ClusterSpec, LocalCluster
from kvwire.cluster.paths import default_model_dir
from kvwire.connectors.config import LAYERWISE_KINDS, ConnectorKind


def up(model: Annotated[Path | None, typer.Option("--model", help="Checkpoint; a tiny random one by default.")] = None,
       host: Host = "127.0.0.1",
       port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Router HTTP port.")] = 8000,
       redis_url: OptionalRedisUrl = None, connector: Connector = ConnectorKind.AUTO,
       kv_deadline: KVDeadline = 10.0, auth_secret_file: AuthSecretFile = None, layerwise: Layerwise = False,
       max_restarts: Annotated[int | None, typer.Option(
           "--max-restarts", min=0, help="Crashed processes restarted in all before everything stops; "
                                         "unlimited by default.")] = None,
       served_model_name: ServedModelName = None, lenient: Lenient = False,
       decode_only_below: Annotated[int, typer.Option(
           "--decode-only-below", min=0, help="The router's: a prompt of which the decode node holds all but fewer "
                                              "than this many tokens (in its prefix cache) is computed there, without "
                                              "a transfer (0: every prompt disaggregated)."
       )] = 0,
       otlp_traces_endpoint: TracesEndpoint = "", log_level: LogLevel = "WARNING") -> None:
    """Start Redis, a prefill node, a decode node and the router; stop them all on Ctrl-C."""
    require("up", *for_cluster(connector, redis_url))
    if layerwise and connector not in LAYERWISE_KINDS:
        raise typer.BadParameter("layer-wise streaming runs over the tcp and ucx connectors", param_hint="--layerwise")
    setup_logging(log_level)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    spec = ClusterSpec(model_dir=model or default_model_dir(), connector=connector, host=host, port=port,
                       redis_url=redis_url, kv_deadline_s=kv_deadline, log_level=log_level,
                       auth_secret_file=auth_secret_file, layerwise=layerwise, max_restarts=max_restarts,
                       served_model_names=served_model_names(served_model_name), lenient=lenient,
                       decode_only_below=decode_only_below, traces_endpoint=traces_endpoint(otlp_traces_endpoint))
    auth_secret(auth_secret_file)  # a bad file fails here, not in four children
    with cluster_of(spec, "up") as cluster:
        typer.echo(f"kvwire is up: {cluster.url}  (model {spec.model_dir}, connector {connector}, "
                   f"redis {cluster.redis_url})")
        typer.echo("ops endpoints (/healthz /readyz /metrics): "
                   + "  ".join(f"{name} {url}" for name, url in cluster.ops_urls.items()))
        typer.echo(f"try: kvwire generate 'Hello' --url {cluster.url}    Ctrl-C stops everything.")
        while not stop.wait(0.5):
            if line := cluster.revive_redis():
                typer.echo(line, err=True)
            if cluster.supervisor.gave_up.is_set():
                typer.echo("kvwire: --max-restarts used up; shutting down", err=True)
                raise typer.Exit(1)
    typer.echo("kvwire stopped")


@contextlib.contextmanager
def cluster_of(spec: ClusterSpec, command: str) -> Iterator[LocalCluster]:
    """The local cluster of `spec`, started, and stopped on leaving. A start that fails (a child exited, time ran
    out) is one line on stderr after the children's own errors, and exit 1: not a traceback."""
    try:
        cluster = LocalCluster(spec).start()
    except ClusterError as exc:
        typer.echo(f"kvwire {command}: {exc} (the processes' own errors are above)", err=True)
        raise typer.Exit(1) from None
    try:
        yield cluster
    finally:
        cluster.stop()
