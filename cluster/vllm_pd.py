"""A disaggregated vLLM pair on this host, the kvwire router in front: for tests, benchmarks and demos.

1. `kvwire_pair(...)` or `nixl_pair(...)` describe the two servers: prefill pinned to core 0,
   decode to core 1, with KvwireConnector over one transport or with vLLM's NixlConnector.
2. `pd_cluster_of(prefill, decode, log_dir)` starts both side by side (cluster/vllm_cluster.py),
   then `kvwire router --vllm-prefill ... --vllm-decode ...` in front (and with `sequential_router`
   a second one, `--sequential`, in front of the same two), and yields a `PDCluster`.
3. Leaving the `with` block (an exception and Ctrl-C included) stops the routers, then both
   servers, each with its whole process group.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2

from kvwire.cluster.local_cluster import ClusterError
from kvwire.cluster.ports import free_port
from kvwire.cluster.vllm_cluster import VLLMConnector, VLLMServer, VLLMServerSpec, start_all
from kvwire.connectors.config import ConnectorKind

DTYPE = "float32"  # bf16's rounding differs between a prompt's forward and a one-token step over pulled KV
ROUTER_START_S = 60.0


@dataclass
class PDCluster:
    prefill: VLLMServer
    decode: VLLMServer
    router_url: str  # the router with its default flags
    routers: list[subprocess.Popen]
    sequential_url: str = ""  # the router with --sequential (if asked for)

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """The decode server's vllm:prompt_tokens_by_source_total, by source."""
        return self._by_label("vllm:prompt_tokens_by_source_total", "source")

    def kv_failed_by_reason(self) -> dict[str, float]:
        """The decode server's vllm:kvwire_kv_transfers_failed_total (prompts recomputed), by reason."""
        return self._by_label("vllm:kvwire_kv_transfers_failed_total", "reason")

    def kv_pulls(self) -> float:
        """The decode server's vllm:kvwire_kv_pulls_total."""
        return sum(self._by_label("vllm:kvwire_kv_pulls_total", "engine").values())

    def kv_pulls_by_path(self) -> dict[str, float]:
        """The decode server's vllm:kvwire_kv_pulls_by_path_total: pulls by what carried them ("cma", "sysv"...)."""
        return self._by_label("vllm:kvwire_kv_pulls_by_path_total", "path")

    def kv_fallbacks(self) -> dict[str, float]:
        """The decode server's vllm:kvwire_kv_transport_fallbacks_total, by reason."""
        return self._by_label("vllm:kvwire_kv_transport_fallbacks_total", "reason")

    def kv_pull_bytes(self) -> float:
        """The decode server's vllm:kvwire_kv_pull_bytes_total."""
        return sum(self._by_label("vllm:kvwire_kv_pull_bytes_total", "engine").values())

    def path_reasons(self) -> dict[str, float]:
        """The default router's kvwire_vllm_path_reasons_total (answers by why their path was taken), by reason."""
        return self._by_label("kvwire_vllm_path_reasons_total", "reason", self.router_url)

    def _by_label(self, name: str, label: str, url: str = "") -> dict[str, float]:
        return counter_by_label(url or self.decode.url, name, label)


def counter_by_label(url: str, name: str, label: str) -> dict[str, float]:
    """The series `name` of the server at `url`'s GET /metrics, by the value of its `label` (the series of a
    data-parallel server's engines summed)."""
    text = httpx2.get(f"{url}/metrics", timeout=10).text
    pattern = rf'^{re.escape(name)}\{{[^}}]*{label}="([^"]+)"[^}}]*\}} (\S+)$'
    out: dict[str, float] = {}
    for m in re.finditer(pattern, text, re.M):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


ALWAYS_DISAGGREGATE = ("--decode-only-below", "0")  # a pair's routers: every request tests the transfer


def start_router(prefill_urls: list[str], decode_urls: list[str], log_path: Path,
                 extra_args: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
    """`kvwire router` in vLLM mode on a free port (with `extra_args`, e.g. `--sequential`); returns its URL and
    process once /healthz answers.

    Raises:
        ClusterError: the router exited or did not answer within ROUTER_START_S (it is killed then).
    """
    port = free_port()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", "router", "--vllm-prefill",
                                 ",".join(prefill_urls), "--vllm-decode", ",".join(decode_urls), "--port", str(port),
                                 *extra_args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"router exited ({proc.returncode}); see {log_path}")
        try:
            if httpx2.get(f"{url}/healthz", timeout=2).status_code == 200:
                return url, proc
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise ClusterError(f"router not ready; see {log_path}")


def kvwire_pair(model_dir: Path, redis_url: str, transport: ConnectorKind, log_dir: Path,
                kv_deadline_s: float = 30.0, named: bool = True,
                dtype: str = DTYPE) -> tuple[VLLMServerSpec, VLLMServerSpec]:
    """Prefill (core 0) and decode (core 1) with KvwireConnector over `transport`, given node ids
    `prefill-<transport>` and `decode-<transport>`, or with `named=False` none (the connector's default)."""
    def spec(role: str, kv_role: str, core: str) -> VLLMServerSpec:
        return VLLMServerSpec(model_dir, kv_role=kv_role, redis_url=redis_url, transport=transport,
                              node_id=f"{role}-{transport}" if named else "", kv_deadline_s=kv_deadline_s,
                              cpu_cores=core, dtype=dtype, log_path=log_dir / f"{role}.log")

    return spec("prefill", "kv_producer", "0"), spec("decode", "kv_consumer", "1")


def nixl_pair(model_dir: Path, log_dir: Path) -> tuple[VLLMServerSpec, VLLMServerSpec]:
    """Prefill (core 0) and decode (core 1) with vLLM's NixlConnector on host memory, each with its
    own side-channel port (NIXL's handshake)."""
    def spec(role: str, kv_role: str, core: str) -> VLLMServerSpec:
        return VLLMServerSpec(model_dir, kv_role=kv_role, connector=VLLMConnector.NIXL, cpu_cores=core,
                              dtype=DTYPE, log_path=log_dir / f"{role}.log",
                              extra_env=(("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port())),))

    return spec("prefill", "kv_producer", "0"), spec("decode", "kv_consumer", "1")


def with_tp(pair: tuple[VLLMServerSpec, VLLMServerSpec], prefill_tp: int,
            decode_tp: int) -> tuple[VLLMServerSpec, VLLMServerSpec]:
    """`pair` with each server's tensor-parallel size, bound as a user binds them on this host's 2 cores: each
    rank of a TP=2 server on a core of its own ("0|1"), a TP=1 server beside it on core 1 (a 1x1 pair keeps
    kvwire_pair's binding: prefill on core 0, decode on core 1).

    Ranks that share a core with another server's spin there: vLLM's workers poll their queue on sched_yield
    for a second after each step, and kvwire's UCX threads poll a pull's progress. Until kvwire's polls
    napped once nothing moved (connectors/spin.py), every first pull between such servers over UCX missed
    its 30 s deadline on this host's kernel (6.18), and the servers ran unbound, the TP=2 one at idle priority.
    """
    if (prefill_tp, decode_tp) == (1, 1):
        return pair
    prefill, decode = pair

    def bound(spec: VLLMServerSpec, tp: int) -> VLLMServerSpec:
        return dataclasses.replace(spec, tensor_parallel_size=tp, cpu_cores="|".join(map(str, range(tp))) if tp > 1
                                   else "1")

    return bound(prefill, prefill_tp), bound(decode, decode_tp)


def stop_router(router: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    router.terminate()
    try:
        router.wait(10)
    except subprocess.TimeoutExpired:
        router.kill()
        router.wait()


@contextmanager
def routed(servers: list[VLLMServer], prefill_urls: list[str], decode_urls: list[str], log_path: Path,
           extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """`start_router` in front of `servers` (started), its URL; on exit the router and every one of `servers`
    stopped (on a failed start too)."""
    router = None
    try:
        url, router = start_router(prefill_urls, decode_urls, log_path, extra_args)
        yield url
    finally:
        if router is not None:
            stop_router(router)
        for server in servers:
            server.stop()


@contextmanager
def pd_cluster_of(prefill_spec: VLLMServerSpec, decode_spec: VLLMServerSpec, log_dir: Path,
                  sequential_router: bool = False) -> Iterator[PDCluster]:
    """Both servers started side by side, the router in front (and a `--sequential` one with `sequential_router`),
    each disaggregating every request (ALWAYS_DISAGGREGATE); everything stopped on exit.

    Raises:
        ClusterError: a server or a router did not start (what did start is stopped).
    """
    prefill, decode = start_all([prefill_spec, decode_spec])
    routers: list[subprocess.Popen] = []
    cluster = None
    try:
        url, router = start_router([prefill.url], [decode.url], log_dir / "router.log", ALWAYS_DISAGGREGATE)
        routers.append(router)
        cluster = PDCluster(prefill, decode, url, routers)
        if sequential_router:
            cluster.sequential_url, router = start_router([prefill.url], [decode.url],
                                                          log_dir / "router-sequential.log",
                                                          (*ALWAYS_DISAGGREGATE, "--sequential"))
            routers.append(router)
        yield cluster
    finally:
        for router in routers:
            stop_router(router)
        now = [] if cluster is None else [cluster.prefill, cluster.decode]
        replaced = [s for s in now if s is not prefill and s is not decode]  # put in the cluster by a restart
        for server in (prefill, decode, *replaced):
            server.stop()

