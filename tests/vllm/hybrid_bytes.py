"""The bytes kvwire moves per prompt for the tiny Gemma 3, vLLM's hybrid KV cache manager on and off.

    .venv-vllm/bin/python -m tests.vllm.hybrid_bytes [WORK_DIR]

A kvwire UCX pair behind the router (kvwire.cluster.vllm_pd, minimal config) serves three distinct prompts
(about 270, 980 and 1,870 tokens, max_tokens 8); each prompt's growth of the decode server's
vllm:kvwire_kv_pull_bytes_total is printed, first with the manager on (vLLM's default: kvwire is
SupportsHMA), then with --disable-hybrid-kv-cache-manager on both servers (every layer's full-length KV).
docs/BENCHMARKS.md holds a run.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import httpx2

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_pd import kvwire_pair, pd_cluster_of
from kvwire.connectors.config import ConnectorKind
from tests.vllm.models import write_tiny_gemma3

TEXT = "The quick brown fox jumps over the lazy dog, then rests in the shade of an old oak tree. "
PROMPTS = [f"{k}: " + TEXT * k for k in (3, 11, 21)]  # distinct from their first block: no prefix-cache hits


def main(work: Path) -> None:
    model = write_tiny_gemma3(work / "gemma3")
    with LocalRedis() as redis:
        for hybrid in (True, False):
            log_dir = work / f"logs-hybrid-{'on' if hybrid else 'off'}"
            log_dir.mkdir(parents=True, exist_ok=True)
            pair = kvwire_pair(model, redis.url, ConnectorKind.UCX, log_dir, named=False)
            if not hybrid:
                pair = tuple(dataclasses.replace(s, extra_args=("--disable-hybrid-kv-cache-manager",)) for s in pair)
            with pd_cluster_of(*pair, log_dir) as cluster:
                for prompt in PROMPTS:
                    before = cluster.kv_pull_bytes()
                    out = httpx2.post(f"{cluster.router_url}/v1/completions", timeout=120, json={
                        "model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
                    state = "on " if hybrid else "off"
                    print(f"hybrid manager {state}  prompt tokens {out['usage']['prompt_tokens']:>5}"
                          f"  KV bytes {int(cluster.kv_pull_bytes() - before):>10,}  text {out['choices'][0]['text']!r}"
                          f"  decode computed {cluster.prompt_tokens_by_source().get('local_compute', 0):.0f}",
                          flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kvwire-hybrid-")))
