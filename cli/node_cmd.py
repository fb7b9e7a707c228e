"""`kvwire prefill` and `kvwire decode`: run one node in the foreground."""

from __future__ import annotations

import errno
from typing import Annotated

import typer

from kvwire.cli.extras import for_cluster, require
from kvwire.cli.options import (
    AdvertiseHost,
    AuthSecretFile,
    BlockSize,
    Connector,
    DirectoryWait,
    DrainTimeout,
    HeartbeatTTL,
    Host,
    HttpPort,
    KVDeadline,
    Layerwise,
    LogLevel,
    ModelDir,
    NumBlocks,
    PullLanes,
    RedisTimeout,
    RedisUrl,
    RequireFastPath,
    TracesEndpoint,
    VerifyKV,
    Warmup,
    node_config,
    setup_logging,
)
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.connection import DirectoryError

NodeId = Annotated[str | None, typer.Option("--node-id", help="Name in the directory; role-host-pid by default.")]
Port = Annotated[int, typer.Option("--port", min=0, max=65535, help="zmq work port; 0 picks a free one.")]
MaxLen = Annotated[int, typer.Option("--max-model-len", min=0, help="Longest prompt + completion; 0: the model's.")]
Device = Annotated[str, typer.Option("--device", help="torch device, e.g. cpu or cuda:0.")]
Threads = Annotated[int, typer.Option("--torch-threads", min=0,
                                      help="torch intra-op threads; 0: torch's default. 1 avoids oversubscribing "
                                           "cores shared with other nodes.")]

PrefixCache = Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache",
                                           help="Keep computed prompt and answer blocks; a prompt this node computes "
                                                "starts on its longest cached prefix (a conversation's next turn).")]


def _run(role: NodeRole, **kw) -> None:
    require(role.value, *for_cluster(kw["connector"], kw["redis_url"]))
    setup_logging(kw.pop("log_level"))
    config = node_config(role, **kw)
    if role == NodeRole.PREFILL:
        from kvwire.prefill_node.main import run
    else:
        from kvwire.decode_node.main import run
    try:
        run(config)
    except DirectoryError as exc:  # Redis unreachable past --directory-wait: one line, not a traceback
        typer.echo(f"kvwire {role.value}: {exc}", err=True)
        raise typer.Exit(1) from None
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
        typer.echo(f"kvwire {role.value}: {exc.strerror}", err=True)  # which port or address: runtime.py, ops_server.py
        raise typer.Exit(1) from None


def prefill(model: ModelDir, redis_url: RedisUrl, host: Host = "127.0.0.1", port: Port = 0,
            node_id: NodeId = None, connector: Connector = ConnectorKind.AUTO, block_size: BlockSize = 16,
            num_blocks: NumBlocks = 1024, kv_deadline: KVDeadline = 10.0, max_model_len: MaxLen = 0,
            device: Device = "cpu", torch_threads: Threads = 1, http_port: HttpPort = 0,
            auth_secret_file: AuthSecretFile = None, verify_kv: VerifyKV = False, drain_timeout: DrainTimeout = 30.0,
            layerwise: Layerwise = False, advertise_host: AdvertiseHost = None, heartbeat_ttl: HeartbeatTTL = 5.0,
            redis_timeout: RedisTimeout = 5.0, directory_wait: DirectoryWait = 60.0, prefix_cache: PrefixCache = True,
            warmup: Warmup = True, otlp_traces_endpoint: TracesEndpoint = "", log_level: LogLevel = "INFO") -> None:
    """Run a prefill node: compute prompts and publish their KV."""
    _run(NodeRole.PREFILL, **locals())


def decode(model: ModelDir, redis_url: RedisUrl, host: Host = "127.0.0.1", port: Port = 0,
           node_id: NodeId = None, connector: Connector = ConnectorKind.AUTO, block_size: BlockSize = 16,
           num_blocks: NumBlocks = 1024, kv_deadline: KVDeadline = 10.0, max_model_len: MaxLen = 0,
           device: Device = "cpu", torch_threads: Threads = 1, http_port: HttpPort = 0,
           auth_secret_file: AuthSecretFile = None, verify_kv: VerifyKV = False, drain_timeout: DrainTimeout = 30.0,
           pull_lanes: PullLanes = 2, advertise_host: AdvertiseHost = None, require_fast_path: RequireFastPath = False,
           heartbeat_ttl: HeartbeatTTL = 5.0, redis_timeout: RedisTimeout = 5.0, directory_wait: DirectoryWait = 60.0,
           prefix_cache: PrefixCache = True, warmup: Warmup = True, otlp_traces_endpoint: TracesEndpoint = "",
           log_level: LogLevel = "INFO") -> None:
    """Run a decode node: receive prompts' KV and generate tokens."""
    _run(NodeRole.DECODE, **locals())
