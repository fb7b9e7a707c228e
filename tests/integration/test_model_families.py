"""Each model family through the disaggregated path against transformers' own model.

A random checkpoint that transformers builds and saves (tests/engine/hf_checkpoints.py) is served by a
real cluster (prefill node, decode node, router; KV over TCP). 32 greedy tokens with their top-5 logprobs
come back through the router; transformers, teacher-forced on the same tokens, must pick the same argmax at
every step whose top two are further apart than the dtype's tolerance, with top-5 logprobs within it.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest
import torch
import transformers

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind
from tests.engine.hf_checkpoints import make_hf_checkpoint
from tests.procs import FORK

pytestmark = pytest.mark.slow
PROMPT = list(b"Paged attention moves blocks; ")
STEPS, TOP = 32, 5
TOLERANCE = {"float32": 1e-4, "float16": 0.02, "bfloat16": 0.2}  # logprob units


@pytest.mark.parametrize(("family", "dtype", "tied"), [
    ("llama3", "bfloat16", False), ("mistral", "float16", False), ("qwen2", "float32", True),
    ("qwen3", "bfloat16", False)], ids=lambda v: str(v))
def test_family_matches_transformers_through_the_cluster(family, dtype, tied, tmp_path: Path, redis_url: str):
    path = make_hf_checkpoint(family, tmp_path / family, dtype=dtype, tied=tied)
    spec = ClusterSpec(model_dir=path, connector=ConnectorKind.TCP, redis_url=redis_url, num_blocks=64,
                       log_dir=tmp_path / "logs", launch=FORK)
    with LocalCluster(spec) as cluster:
        resp = httpx2.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "logprobs": TOP, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["kvwire"]["bypassed"] is True
    tokens = body["choices"][0]["token_ids"]
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tokens) == STEPS
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].float()  # [STEPS, vocab]
    want = torch.log_softmax(logits, dim=-1)
    tol = TOLERANCE[dtype]
    for step, (token, top) in enumerate(zip(tokens, tops, strict=True)):
        best2 = torch.topk(want[step], 2).values
        if best2[0] - best2[1] > tol:
            assert token == int(torch.argmax(want[step])), f"{family} step {step}"
        for name, value in top.items():
            assert abs(value - float(want[step, int(name.removeprefix("token_id:"))])) <= tol, (family, step, name)
