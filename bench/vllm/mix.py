"""The prompt mix `kvwire bench vllm` sends, and one streamed request measured at the client.

Every request gets a prompt of its own: a tag naming it (`r1-p2`: round 1, prompt 2) opens the
text, so no request finds another's blocks in a prefix cache, and the same tag gives the same
prompt on every setup, so their outputs can be compared token by token. The kvwire models speak
bytes, one token a byte (no bos added): a prompt of `n` ASCII characters is `n` tokens.
"""

from __future__ import annotations

import json
import random
import time
from typing import NamedTuple

import httpx2
import msgspec

from kvwire.router.vllm.prefill import PATH_HEADER

_WORDS = ("the prefill node computes every prompt token once and the decode node pulls its key value "
          "blocks over the wire before the first step while a router in front picks both instances "
          "so a long prompt does not stall the tokens other requests are waiting for").split()


class Ask(NamedTuple):
    """One request of the mix: its tag and its prompt length in tokens."""

    tag: str
    tokens: int


class Sample(msgspec.Struct, frozen=True):
    """One streamed answer, timed at the client."""

    tag: str
    ttft_ms: float  # sending the request to the first streamed chunk with a choice
    tpot_ms: float  # first chunk to last, over the output tokens after the first
    latency_ms: float  # sending the request to the last chunk with a choice
    prompt_tokens: int
    output_tokens: int
    token_ids: list[int]
    path: str  # the router's x-kvwire-path ("" from a server with no router in front)


class RequestError(RuntimeError):
    """A request of the bench failed: an error status, or a stream with no tokens or no usage."""

    def __init__(self, tag: str, url: str, reason: str):
        super().__init__(f"request {tag} to {url}: {reason}")
        self.tag = tag
        self.url = url
        self.reason = reason


def make_prompt(tag: str, tokens: int) -> str:
    """`tokens` ASCII characters opening with `[tag]`, the rest words drawn with the tag as seed."""
    rng = random.Random(tag)
    text = f"[{tag}]"
    while len(text) < tokens:
        text += " " + rng.choice(_WORDS)
    return text[:tokens]


def sequential_asks(lengths: list[int], rounds: int, prefix: str = "") -> list[Ask]:
    """`rounds` passes over the mix, one request after another; `prefix` opens every tag (a second router in front
    of the same servers gets prompts of its own, which the first left in no prefix cache)."""
    return [Ask(f"{prefix}r{r}-p{i}", n) for r in range(rounds) for i, n in enumerate(lengths)]


def concurrent_asks(lengths: list[int], rounds: int, prefix: str = "") -> list[Ask]:
    """As many requests as the sequential passes, with prompts of their own, for the concurrent pass."""
    return [Ask(f"{prefix}c{r}-p{i}", n) for r in range(rounds) for i, n in enumerate(lengths)]


def stream_one(client: httpx2.Client, url: str, model: str, ask: Ask, max_tokens: int) -> Sample:
    """Send one greedy completion, streamed, and time it.

    Raises:
        RequestError: an error status, or a stream without tokens or without its usage chunk.
    """
    body = {"model": model, "prompt": make_prompt(ask.tag, ask.tokens), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    first = last = 0.0
    ids: list[int] = []
    usage = None
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RequestError(ask.tag, url, f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        path = resp.headers.get(PATH_HEADER, "")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
                ids += chunk["choices"][0].get("token_ids") or []
            usage = chunk.get("usage") or usage
    if not first or usage is None:
        raise RequestError(ask.tag, url, "the stream ended without tokens or without its usage chunk")
    out = int(usage["completion_tokens"])
    return Sample(ask.tag, ttft_ms=(first - start) * 1e3, tpot_ms=(last - first) * 1e3 / max(1, out - 1),
                  latency_ms=(last - start) * 1e3,
                  prompt_tokens=int(usage["prompt_tokens"]), output_tokens=out, token_ids=ids, path=path)
