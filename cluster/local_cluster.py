"""A whole kvwire cluster on this host: private Redis, one prefill, one decode, the router.

1. `start()` starts a private redis-server (unless a URL is given) and spawns the
   prefill node, decode node and router as supervised child processes of this one
   (cluster/supervisor.py; they die with this process too). Each node also serves /healthz,
   /readyz and /metrics on a free port of its own (`ops_urls`).
2. It returns once the router's /readyz says it can disaggregate (a live prefill node, and
   every decode node live: each registers once warmed up); from then on a child that
   crashes is restarted with its command line (the router on the same port) while the
   others keep serving. `stop_process` stops one on purpose: it stays down.
3. `stop()` (also on exit of the `with` block) stops restarting, sends SIGTERM to every
   child, SIGKILL to any still alive after a grace period, removes the Unix sockets a
   SIGKILLed producer left, and stops Redis, so nothing is left behind.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

from kvwire.cluster.ports import free_port
from kvwire.cluster.redis_server import LocalRedis, LocalRedisError
from kvwire.cluster.supervisor import ChildProcess, Launcher, Supervisor
from kvwire.connectors.config import ConnectorKind

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    connector: ConnectorKind = ConnectorKind.AUTO
    host: str = "127.0.0.1"
    port: int = 0  # router HTTP port; 0 picks a free one
    redis_url: str | None = None
    kv_deadline_s: float = 10.0
    num_blocks: int = 1024
    block_size: int = 16
    log_dir: Path | None = None  # children's output; inherited from this process when None
    auth_secret_file: Path | None = None  # every child seals its control messages with this secret
    log_level: str = "INFO"
    prefill_device: str = "cpu"
    decode_device: str = "cpu"
    layerwise: bool = False  # the prefill node streams each prompt's KV layer by layer (tcp or ucx connector)
    max_restarts: int | None = None  # crashed children restarted in all before giving up; None: no limit
    request_timeout_s: float | None = None  # the router's --request-timeout; None: its default
    served_model_names: tuple[str, ...] = ()  # the router's --served-model-name; empty: the checkpoint's name
    lenient: bool = False  # the router's --lenient: unknown request fields dropped, not refused
    decode_only_below: int = 0  # the router's --decode-only-below: prompts with fewer uncached tokens stay on decode
    require_fast_path: bool = False  # the decode node's --require-fast-path: a same-host slow path is refused
    heartbeat_ttl_s: float = 5.0  # both nodes' --heartbeat-ttl: how long a dead node stays registered
    decode_nodes: int = 1  # decode nodes: "decode" (id decode-0), then "decode-1" ... (the router picks among them)
    warmup: bool = True  # the nodes warm up before they register; False: `--no-warmup` (cold first requests)
    prefix_cache: bool = True  # every node keeps computed blocks for later prompts; False: `--no-prefix-cache`
    traces_endpoint: str = ""  # every child's --otlp-traces-endpoint ("": what the environment says)
    launch: Launcher | None = None  # how children start; None: `python -m kvwire.cli.main` (cluster/forked.py)


@dataclass
class LocalCluster:
    spec: ClusterSpec
    redis: LocalRedis | None = None
    redis_url: str = ""
    port: int = 0
    supervisor: Supervisor = field(init=False)
    http_ports: dict[str, int] = field(default_factory=dict)  # node role -> its ops endpoint's port

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.spec.log_dir, self.spec.max_restarts, launch=self.spec.launch)

    @property
    def procs(self) -> dict[str, ChildProcess]:
        """Each child's current process (a restart replaces it)."""
        return self.supervisor.procs

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def ops_urls(self) -> dict[str, str]:
        """Base URL serving /healthz, /readyz and /metrics of "router", "prefill", "decode" (and "decode-N")."""
        nodes = {role: f"http://{self.spec.host}:{port}" for role, port in self.http_ports.items()}
        return {"router": self.url, **nodes}

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.spec.redis_url:
            self.redis_url = self.spec.redis_url
        else:
            self.redis = LocalRedis().start()
            self.redis_url = self.redis.url
        self.port = self.spec.port or free_port(self.spec.host)
        for name in ("prefill", "decode", *(f"decode-{i}" for i in range(1, self.spec.decode_nodes))):
            self.http_ports[name] = free_port(self.spec.host)
            self.spawn(name, self._node_args(name))
        self.spawn("router", self._router_args())
        self.wait_ready()
        self.supervisor.armed.set()

    def _router_args(self) -> list[str]:
        s = self.spec
        extra = [] if s.request_timeout_s is None else ["--request-timeout", str(s.request_timeout_s)]
        extra += ["--served-model-name", ",".join(s.served_model_names)] if s.served_model_names else []
        extra += ["--lenient"] if s.lenient else []
        extra += ["--decode-only-below", str(s.decode_only_below)] if s.decode_only_below else []
        return ["router", "--model", str(s.model_dir), "--redis-url", self.redis_url, "--host", s.host,
                "--port", str(self.port), "--log-level", s.log_level, *extra, *self._auth_args(), *self._trace_args()]

    def _auth_args(self) -> list[str]:
        path = self.spec.auth_secret_file
        return [] if path is None else ["--auth-secret-file", str(path)]

    def _trace_args(self) -> list[str]:
        return ["--otlp-traces-endpoint", self.spec.traces_endpoint] if self.spec.traces_endpoint else []

    def _node_args(self, name: str) -> list[str]:
        """`name`: "prefill", "decode" (their id ends in -0) or "decode-N"."""
        s, role = self.spec, name.split("-")[0]
        return [role, "--model", str(s.model_dir), "--redis-url", self.redis_url, "--host", s.host,
                "--node-id", name if "-" in name else f"{role}-0", "--connector", str(s.connector),
                "--block-size", str(s.block_size),
                "--num-blocks", str(s.num_blocks), "--kv-deadline", str(s.kv_deadline_s),
                "--device", s.prefill_device if role == "prefill" else s.decode_device, "--log-level", s.log_level,
                "--http-port", str(self.http_ports[name]), "--heartbeat-ttl", str(s.heartbeat_ttl_s),
                *self._auth_args(),
                *(["--layerwise"] if s.layerwise and role == "prefill" else []),
                *(["--require-fast-path"] if s.require_fast_path and role == "decode" else []),
                *([] if s.prefix_cache else ["--no-prefix-cache"]),
                *([] if s.warmup else ["--no-warmup"]), *self._trace_args()]

    def spawn(self, name: str, args: list[str]) -> ChildProcess:
        """Start `python -m kvwire.cli.main ARGS` as a supervised child named `name`."""
        return self.supervisor.start(name, args)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until the router can disaggregate over every node started: its /readyz lists a live prefill
        node and `decode_nodes` live decode nodes (nodes register once warmed up, so the first requests find
        them warm and are not recomputed). Raises ClusterError if a child dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        with httpx2.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
                if dead and not self.supervisor.armed.is_set():
                    raise ClusterError(f"processes exited during start-up: {dead}")
                try:
                    body = client.get(f"{self.url}/readyz").json()
                    if body.get("disaggregate") and body.get("decode_nodes", 0) >= self.spec.decode_nodes:
                        return
                except (httpx2.HTTPError, ValueError):  # not listening yet, or not JSON yet
                    pass
                time.sleep(0.2)  # start-up only: children are loading models
        raise ClusterError(f"cluster not ready within {timeout_s:.0f}s")

    def revive_redis(self) -> str | None:
        """Start the private Redis again if it died: empty, so nodes re-register at their next heartbeat and
        requests in flight recompute. Returns the line to report, or None when it runs (or is not ours)."""
        if self.redis is None or self.redis.running:
            return None
        try:
            self.redis.restart()
        except LocalRedisError as exc:
            return f"kvwire: redis-server died; restarting it failed (trying again): {exc}"
        return f"kvwire: redis-server died; restarted it, empty, on port {self.redis.port}"

    def stop_process(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:
        """Stop child `name` on purpose with `sig` (SIGKILL after `grace_s`): it is not restarted."""
        return self.supervisor.stop(name, sig, grace_s)

    def stop(self) -> None:
        self.supervisor.close(order=["router", "prefill", "decode"])
        _remove_dead_sockets([f"{role}-0" for role in ("prefill", "decode")])
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _remove_dead_sockets(node_ids: list[str]) -> None:
    """The Unix sockets a SIGKILLed shared-memory producer left (its next incarnation would remove them)."""
    from kvwire.connectors.transports.shm.channel import remove_stale, socket_dir

    try:
        directory = socket_dir()
    except OSError:
        return
    for node_id in node_ids:
        remove_stale(directory, node_id)
