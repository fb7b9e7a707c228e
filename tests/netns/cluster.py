"""A kvwire cluster on the two-host topology: Redis and the router in the root namespace, the
prefill node in namespace A, the decode node in namespace B.

1. `NetnsCluster(topology, model_dir, log_dir).start()` starts Redis (bound to loopback and
   to each namespace's Redis address) and the router (on A's gateway address, which B
   reaches through the root namespace).
2. `start_nodes(connector)` starts a prefill and a decode node over `connector`, each with
   `--host 0.0.0.0` and no `--advertise-host`, so each publishes the address it picks for
   itself (the one that routes to Redis), and waits until both are ready and the router
   sees them. Calling it again replaces both nodes.
3. `stop()` ends every child (SIGCONT first, in case a test left one stopped) and Redis.

Its children are supervised like `kvwire up`'s (cluster/supervisor.py): one that crashes once the
nodes are up is restarted with its command line; `stop_process` stops one for good.

It offers what tests/faults/harness.py reads of a cluster (`url`, `redis_url`, `ops_urls`,
`procs`), so the fault helpers there (`wait_recovered`, `pool`, `metric`) work on it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import redis

from kvwire.cluster.redis_server import find_redis_server
from kvwire.cluster.supervisor import Supervisor
from kvwire.connectors.config import ConnectorKind
from tests.faults.harness import KV_DEADLINE_S, REQUEST_TIMEOUT_S, wait_until
from tests.netns.topology import Namespace, Topology

BS = 16
HEARTBEAT_TTL_S = 2.0  # the nodes' lease (--heartbeat-ttl): the faults outlast it sooner than at the default 5 s
REDIS_TIMEOUT_S = 2.0  # the nodes' --redis-timeout: a cut from Redis outlasts it sooner than the default 5 s
WORK_PORT, OPS_PORT = 17100, 17180  # in each node's own namespace: nothing else listens there
ROUTER_PORT = 17200
READY_TIMEOUT_S = 120.0


class NetnsClusterError(RuntimeError):
    pass


@dataclass
class NetnsCluster:
    topo: Topology
    model_dir: Path
    log_dir: Path
    redis_port: int = 0
    connector: ConnectorKind | None = None
    supervisor: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.log_dir, command=())

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return self.supervisor.procs

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def url(self) -> str:
        return f"http://{self.topo.router_host}:{ROUTER_PORT}"

    @property
    def ops_urls(self) -> dict[str, str]:
        return {"router": self.url, "prefill": f"http://{self.topo.a.address}:{OPS_PORT}",
                "decode": f"http://{self.topo.b.address}:{OPS_PORT}"}

    def namespace(self, role: str) -> Namespace:
        return self.topo.a if role == "prefill" else self.topo.b

    def start(self) -> NetnsCluster:
        try:
            self._start_redis()
            self.spawn("router", [sys.executable, "-m", "kvwire.cli.main", "router", "--model", str(self.model_dir),
                                  "--redis-url", self.redis_url, "--host", self.topo.router_host,
                                  "--port", str(ROUTER_PORT), "--request-timeout", str(REQUEST_TIMEOUT_S)])
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.redis_port = probe.getsockname()[1]
        binds = ["127.0.0.1", self.topo.a.redis_address, self.topo.b.redis_address]
        self.spawn("redis", [str(find_redis_server()), "--port", str(self.redis_port), "--bind", *binds,
                             "--save", "", "--appendonly", "no", "--protected-mode", "no"])
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1)
        try:
            if not wait_until(lambda: _pings(client), 10, 0.1):
                raise NetnsClusterError("redis-server did not answer PING")
        finally:
            client.close()

    def node_args(self, role: str) -> list[str]:
        ns = self.namespace(role)
        assert self.connector is not None
        return [*ns.exec_prefix(), sys.executable, "-m", "kvwire.cli.main", role, "--model", str(self.model_dir),
                "--redis-url", f"redis://{ns.redis_address}:{self.redis_port}/0", "--host", "0.0.0.0",
                "--port", str(WORK_PORT), "--http-port", str(OPS_PORT), "--node-id", f"{role}-0",
                "--connector", str(self.connector), "--block-size", str(BS), "--num-blocks", "256",
                "--kv-deadline", str(KV_DEADLINE_S), "--torch-threads", "1", "--drain-timeout", "3",
                "--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--redis-timeout", str(REDIS_TIMEOUT_S)]

    def start_nodes(self, connector: ConnectorKind) -> None:
        """(Re)start both nodes over `connector` and wait until the router sees them."""
        for role in ("decode", "prefill"):
            self.stop_process(role)
        self.connector = connector
        for role in ("prefill", "decode"):
            self.spawn(role, self.node_args(role))
        for role in ("prefill", "decode"):
            self.wait_ready(role)
        if not wait_until(lambda: _status(f"{self.url}/healthz") == 200, 30, 0.2):
            raise NetnsClusterError("the router does not see both nodes")
        self.supervisor.armed.set()

    def restart_node(self, role: str) -> None:
        """Start `role` again (after it died or was killed) and wait until it is ready."""
        self.stop_process(role, signal.SIGKILL)
        self.supervisor.resume(role)
        self.wait_ready(role)

    def wait_ready(self, role: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        proc = self.procs[role]
        deadline = time.monotonic() + timeout_s
        while _status(f"{self.ops_urls[role]}/readyz") != 200:
            if proc.poll() is not None:
                raise NetnsClusterError(f"{role} exited with {proc.returncode} (log: {self.log_dir / role}.log)")
            if time.monotonic() > deadline:
                raise NetnsClusterError(f"{role} not ready within {timeout_s:.0f}s")
            time.sleep(0.2)  # start-up: the node is loading its model

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        return self.supervisor.start(name, argv)

    def stop_process(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
        self.supervisor.stop(name, sig, grace_s)

    def stop(self) -> None:
        self.supervisor.close(order=["router", "decode", "prefill"])


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _status(url: str) -> int | None:
    try:
        return httpx2.get(url, timeout=2).status_code
    except httpx2.HTTPError:
        return None
