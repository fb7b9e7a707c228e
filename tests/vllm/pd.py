"""A disaggregated vLLM pair with KvwireConnector, the kvwire router in front, and a plain server to compare with."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvwire.cli.local_cluster import ClusterError, free_port
from kvwire.cli.vllm_cluster import VLLMServer, VLLMServerSpec, start_all
from kvwire.connectors.config import ConnectorKind


DTYPE = "float32"  # bf16's rounding differs between a prompt's forward and a one-token step over pulled KV


@dataclass
class PDCluster:
    prefill: VLLMServer
    decode: VLLMServer
    router_url: str
    router: subprocess.Popen

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """The decode server's vllm:prompt_tokens_by_source_total, by source."""
        text = httpx.get(f"{self.decode.url}/metrics", timeout=10).text
        pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


def start_router(prefill_urls: list[str], decode_urls: list[str], log_path: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", "router", "--vllm-prefill",
                                 ",".join(prefill_urls), "--vllm-decode", ",".join(decode_urls), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"router exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise ClusterError(f"router not ready; see {log_path}")


@contextmanager
def pd_cluster(model_dir: Path, redis_url: str, transport: ConnectorKind, log_dir: Path, kv_deadline_s: float = 30.0):
    """Prefill on core 0, decode on core 1, router in front; everything stopped on exit."""
    common = {"model_dir": model_dir, "redis_url": redis_url, "transport": transport, "kv_deadline_s": kv_deadline_s,
              "dtype": DTYPE}
    prefill, decode = start_all([
        VLLMServerSpec(kv_role="kv_producer", node_id=f"prefill-{transport}", cpu_cores="0",
                       log_path=log_dir / "prefill.log", **common),
        VLLMServerSpec(kv_role="kv_consumer", node_id=f"decode-{transport}", cpu_cores="1",
                       log_path=log_dir / "decode.log", **common)])
    router = None
    try:
        url, router = start_router([prefill.url], [decode.url], log_dir / "router.log")
        yield PDCluster(prefill, decode, url, router)
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        prefill.stop()
        decode.stop()
