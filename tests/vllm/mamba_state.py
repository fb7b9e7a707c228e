"""A tiny Qwen3-Next through a kvwire pair against one plain vLLM server: what moves, what matches.

    .venv-vllm/bin/python -m tests.vllm.mamba_state [WORK_DIR]

With vLLM's prefix caching on (its Mamba cache mode "align") and then off ("none"): a plain server
answers each prompt (max_tokens 16, greedy, top-2 logprobs), then a kvwire UCX pair behind the router
(kvwire.cluster.vllm_pd, minimal config), bf16. Prompts: three of tests/vllm, one of 1,584 tokens (two
attention blocks of 1,152) twice, and its cuts at 1,152, 1,153 and 1,154 tokens (the decode server
loads 1,151, 1,152 and 1,153: the state in the first block, at its end, in the second; with prefix
caching on, the last finds its first block and the state after it in the decode server's cache).
For each: the bytes pulled, whether the tokens are equal, the largest logprob difference up to the
first differing token, and the plain server's top-two gap there. docs/BENCHMARKS.md holds a run.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_cluster import VLLMServer, VLLMServerSpec
from kvwire.cluster.vllm_pd import kvwire_pair, pd_cluster_of
from kvwire.connectors.config import ConnectorKind
from tests.vllm.conftest import PROMPTS
from tests.vllm.models import write_tiny_qwen3_next
from tests.vllm.routed import openai_client
from tests.vllm.test_pd_shapes import Answer, _complete

LONG = "The long prompt crosses an attention block of 1152 tokens, and the state sits in its second block. " * 16
TEXTS = PROMPTS + [LONG, LONG, LONG[:1152], LONG[:1153], LONG[:1154]]  # 1,584 and 1,152..1,154 tokens


def compare(want: Answer, got: Answer) -> str:
    """Equal tokens or where they part, the largest |logprob difference| of the tokens both list before."""
    diff = 0.0
    for i, (mine, theirs) in enumerate(zip(got.top_logprobs, want.top_logprobs)):
        diff = max([diff] + [abs(mine[k] - theirs[k]) for k in set(mine) & set(theirs)])
        if got.tokens[i] != want.tokens[i]:
            gap = max(theirs.values()) - min(theirs.values())
            return f"token {i} differs (plain's top two {gap:.3f} apart)  max |dlogprob| {diff:.4f}"
    return f"tokens equal  max |dlogprob| {diff:.4f}"


def main(work: Path) -> None:
    model = write_tiny_qwen3_next(work / "qwen3_next")
    with LocalRedis() as redis:
        for caching in (True, False):
            args = () if caching else ("--no-enable-prefix-caching",)
            log_dir = work / f"logs-caching-{'on' if caching else 'off'}"
            log_dir.mkdir(parents=True, exist_ok=True)
            plain = VLLMServer(VLLMServerSpec(model, cpu_cores="0", dtype="bfloat16", extra_args=args,
                                              log_path=log_dir / "plain.log")).start()
            plain.wait_ready()
            want = [_complete(openai_client(plain.url), str(model), text) for text in TEXTS]
            plain.stop()
            pair = kvwire_pair(model, redis.url, ConnectorKind.UCX, log_dir, named=False, dtype="bfloat16")
            with pd_cluster_of(*(dataclasses.replace(s, extra_args=args) for s in pair), log_dir) as cluster:
                for text, theirs in zip(TEXTS, want):
                    before, computed = cluster.kv_pull_bytes(), cluster.prompt_tokens_by_source()["local_compute"]
                    got = _complete(openai_client(cluster.router_url), str(model), text)
                    print(f"prefix caching {'on ' if caching else 'off'}  prompt tokens {got.prompt_tokens:>5}"
                          f"  KV bytes {int(cluster.kv_pull_bytes() - before):>10,}  decode computed "
                          f"{cluster.prompt_tokens_by_source()['local_compute'] - computed:.0f}  "
                          f"{compare(theirs, got)}", flush=True)
                print(f"failures by reason: {cluster.kv_failed_by_reason()}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kvwire-mamba-")))
