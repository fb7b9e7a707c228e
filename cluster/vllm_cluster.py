"""vLLM OpenAI servers on this host, with or without kvwire's connector: for tests, benchmarks and demos.

1. `VLLMServer(spec).start()` spawns `python -m vllm.entrypoints.openai.api_server` (the
   `vllm` console script of the CPU package is broken) in a new process group of its own,
   with the connector configured as users configure it (`kv_transfer_config`).
2. `wait_ready()` polls GET /health until it answers (30-45 s on CPU) or the server exits.
3. `stop()` sends SIGTERM to the whole group (API server, engine core, workers), SIGKILL to
   what is left after a grace period; `kill()` is SIGKILL at once, as when a node dies.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

from kvwire.cluster.local_cluster import ClusterError
from kvwire.cluster.ports import free_port
from kvwire.connectors.config import ConnectorKind

GROUP_EXIT_S = 10.0  # how long `stop` waits for SIGKILLed ranks to finish exiting

START_TIMEOUT_S = 240.0
VLLM_MAX_MODEL_LEN = 2048


class VLLMConnector(enum.StrEnum):
    """The vLLM KV connectors a server can be started with, by vLLM's class name."""

    KVWIRE = "KvwireConnector"
    NIXL = "NixlConnector"  # vLLM's own; on the CPU build it moves host memory (kv_buffer_device "cpu")


@dataclass(frozen=True)
class VLLMServerSpec:
    """One vLLM server. `kv_role` None: a plain server, no connector."""

    model_dir: Path
    kv_role: str | None = None  # "kv_producer", "kv_consumer" or "kv_both"
    connector: VLLMConnector = VLLMConnector.KVWIRE
    redis_url: str = ""
    transport: ConnectorKind = ConnectorKind.UCX
    node_id: str = ""
    kv_deadline_s: float = 30.0
    port: int = 0  # 0 picks a free one
    cpu_cores: str = ""  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-1"; "" leaves vLLM's default
    max_model_len: int = VLLM_MAX_MODEL_LEN
    dtype: str = "auto"  # vLLM's --dtype (auto: bf16 on CPU)
    extra_args: tuple[str, ...] = ()
    auth_secret_file: Path | None = None  # kvwire's connector: seals its control plane (kv_connector_extra_config)
    extra_env: tuple[tuple[str, str], ...] = ()  # e.g. NIXL's VLLM_NIXL_SIDE_CHANNEL_PORT, one per server
    tensor_parallel_size: int = 1  # vLLM's --tensor-parallel-size; cpu_cores then names each rank's ("0|1")
    log_path: Path | None = None

    def kv_transfer_config(self) -> str:
        if self.connector == VLLMConnector.NIXL:
            return json.dumps({"kv_connector": str(self.connector), "kv_role": self.kv_role,
                               "kv_buffer_device": "cpu"})
        extra = {"redis_url": self.redis_url, "transport": str(self.transport), "kv_deadline_s": self.kv_deadline_s}
        if self.node_id:
            extra["node_id"] = self.node_id
        if self.auth_secret_file is not None:
            extra["auth_secret_file"] = str(self.auth_secret_file)
        return json.dumps({"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.connectors.vllm",
                           "kv_role": self.kv_role, "kv_connector_extra_config": extra})

    def argv(self, port: int) -> list[str]:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--port", str(port), "--host", "127.0.0.1", "--max-model-len", str(self.max_model_len),
                "--dtype", self.dtype, "--enforce-eager", "--enable-prompt-tokens-details", *self.extra_args]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.kv_role is not None:
            args += ["--kv-transfer-config", self.kv_transfer_config()]
        return args


@dataclass
class VLLMServer:
    spec: VLLMServerSpec
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMServer:
        self.port = self.spec.port or free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               **dict(self.spec.extra_env)}
        if self.spec.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.cpu_cores
        out = None
        if self.spec.log_path is not None:
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.spec.log_path, "ab")  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(self.spec.argv(self.port), env=env, stdout=out,
                                         stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            if out is not None:
                out.close()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Raises ClusterError when the server exits or does not answer /health in time."""
        deadline = time.monotonic() + timeout_s
        with httpx2.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    code = None if self.proc is None else self.proc.returncode
                    raise ClusterError(f"vLLM server on port {self.port} exited during start-up ({code}); "
                                       f"see {self.spec.log_path or 'its output'}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx2.HTTPError:
                    pass
                time.sleep(0.5)  # start-up only: loading the model, profiling
        raise ClusterError(f"vLLM server on port {self.port} not ready within {timeout_s:.0f}s")

    def kill(self) -> None:
        """SIGKILL to the whole process group, as when the node dies."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL to whatever is left after `grace_s`; returns once every rank
        has exited (a rank tearing down gigabytes of memory takes a moment after its SIGKILL)."""
        if self.proc is None or self.proc.poll() is not None:
            self._signal(signal.SIGKILL)  # the leader is gone; its engine and workers may not be
        else:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            self._signal(signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None:
            deadline = time.monotonic() + GROUP_EXIT_S
            while live_group_members(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # nothing to wait on but /proc: the ranks are not our children

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are not zombies (a killed rank waits for init to reap it)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def start_all(specs: list[VLLMServerSpec], timeout_s: float = START_TIMEOUT_S) -> list[VLLMServer]:
    """Start servers side by side and wait for all; on failure, stop them all and raise."""
    servers = [VLLMServer(s) for s in specs]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
