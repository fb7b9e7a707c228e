"""Configuration of one prefill or decode node process, built once in `cli/` and passed down whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwire.connectors.config import ConnectorConfig
from kvwire.engine.engine_config import EngineConfig


@dataclass(frozen=True)
class NodeConfig:
    """One prefill or decode node process: its engine, its connector, where it listens.

    Attributes:
        engine: model and KV pool.
        connector: transport and directory settings (carries node_id, role, redis_url).
        work_port: zmq port taking work from routers; 0 picks a free one.
        heartbeat_ttl_s: the node's directory entry expires this long after its last heartbeat.
        redis_timeout_s: how long one directory command may wait on a silent Redis before it fails.
        directory_wait_s: at start, how long the node waits for a directory that does not answer yet (Redis
            starting beside it) before it exits.
        http_port: port of the node's /healthz, /readyz and /metrics endpoint; 0: none.
        auth_secret: shared secret sealing control messages (connectors/control/auth.py); None: no authentication.
        drain_timeout_s: on SIGTERM, how long the node may take to finish what it holds before it exits.
        warmup: run the engine and the transfer plane once on the node's device before registering
            (engine/warmup.py), so the first requests do not pay the device's start-up.
        traces_endpoint: OTLP/HTTP endpoint for the node's spans (observability/tracing.py); "": none.
    """

    engine: EngineConfig
    connector: ConnectorConfig
    work_port: int = 0
    heartbeat_ttl_s: float = 5.0
    redis_timeout_s: float = 5.0
    directory_wait_s: float = 60.0
    http_port: int = 0
    auth_secret: bytes | None = field(default=None, repr=False)
    drain_timeout_s: float = 30.0
    warmup: bool = True
    traces_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must not be negative, got {self.drain_timeout_s}")

    @property
    def node_id(self) -> str:
        return self.connector.node_id

    @property
    def host(self) -> str:
        return self.connector.host
