"""Where a kvwire pair's Qwen3-Next answers differ from one server's, and why: vLLM's arithmetic, not the bytes.

    .venv-vllm/bin/python -m tests.vllm.mamba_split [WORK_DIR] [--furthest K]

A kvwire pair (`auto`, cma on this host, minimal config, bf16) computes all but a prompt's last token on the
prefill server and that token as a one-token step from the pulled state on the decode server; one server
computes the prompt in one step. For the 3 prompts of tests/vllm and 30 random ones (seeded, 124-1,412 tokens),
this prints how the pair's greedy answer (16 tokens, top-2 logprobs) differs from the prefill server's own
whole-prompt answer; then, for the K prompts that differ most, from a plain server made to take the pair's two
steps (--max-num-batched-tokens of the prompt less one, prefix caching off), started once per prompt.
docs/BENCHMARKS.md holds a run; test_pd_shapes.py's Qwen3-Next shape compares with such a server.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_pd import kvwire_pair, pd_cluster_of
from kvwire.connectors.config import ConnectorKind
from tests.vllm.conftest import PROMPTS
from tests.vllm.mamba_state import compare
from tests.vllm.models import write_tiny_qwen3_next
from tests.vllm.routed import openai_client
from tests.vllm.test_pd_shapes import Answer, _complete, split_server

WORDS = "the of and kv cache decode prefill token block state layer head transfer node request prompt model".split()


def texts(seed: int = 7, count: int = 30) -> list[str]:
    """tests/vllm's prompts and `count` random ones of 20-250 words."""
    rng = random.Random(seed)
    return PROMPTS + [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 250))) for _ in range(count)]


def largest_difference(want: Answer, got: Answer) -> float:
    """The largest |logprob difference| of the tokens both list, up to and including the first differing token."""
    diff = 0.0
    for i, (mine, theirs) in enumerate(zip(got.top_logprobs, want.top_logprobs)):
        diff = max([diff] + [abs(mine[k] - theirs[k]) for k in set(mine) & set(theirs)])
        if got.tokens[i] != want.tokens[i]:
            break
    return diff


def split_answer(model: Path, text: str, num_tokens: int, log_path: Path) -> Answer:
    """A plain server's answer to `text` computed in two steps: all but its last token, then that token."""
    with split_server(model, log_path, num_tokens) as server:
        server.wait_ready()
        return _complete(openai_client(server.url), str(model), text)


def main(work: Path, furthest: int) -> None:
    model = write_tiny_qwen3_next(work / "qwen3_next")
    prompts = texts()
    with LocalRedis() as redis:
        pair = kvwire_pair(model, redis.url, ConnectorKind.AUTO, work, named=False, dtype="bfloat16")
        with pd_cluster_of(*pair, work) as cluster:
            got = [_complete(openai_client(cluster.router_url), str(model), text) for text in prompts]
            whole = [_complete(openai_client(cluster.prefill.url), str(model), text) for text in prompts]
            print(f"pulls by path: {cluster.kv_pulls_by_path()}  failures: {cluster.kv_failed_by_reason()}")
    for i, (mine, theirs) in enumerate(zip(got, whole)):
        print(f"prompt {i:>2}  {mine.prompt_tokens:>5} tokens  pair vs whole-prompt step: {compare(theirs, mine)}")
    ranked = sorted(range(len(prompts)), key=lambda i: -largest_difference(whole[i], got[i]))
    for i in ranked[:furthest]:
        split = split_answer(model, prompts[i], got[i].prompt_tokens, work / f"split-{i}.log")
        same = split.tokens == got[i].tokens and split.top_logprobs == got[i].top_logprobs
        print(f"prompt {i:>2}  pair vs the same two steps on one server: "
              f"{'the same, bit for bit' if same else compare(split, got[i])}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("work", nargs="?", type=Path, default=None)
    parser.add_argument("--furthest", type=int, default=4)
    args = parser.parse_args()
    main(args.work or Path(tempfile.mkdtemp(prefix="kvwire-mamba-split-")), args.furthest)
