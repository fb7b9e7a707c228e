"""What the vLLM pair tests ask and check: the official `openai` client's answers (whole, streamed, chat; sent with
headers if given, e.g. a trace context, and kept with theirs) and `routed_equals_plain`, the check that a pair's router
gives a plain vLLM server's tokens with every prompt token pulled, none computed on the decode server.

`routed_equals_plain` runs over NCCL on test_pd_prefill_life.py's named pair and over `auto`, with every server
kv_both, on test_pd_schedule.py's servers; TCP between vLLM servers runs in test_bench_vllm.py (every answer
equal to the plain server's, every one disaggregated) and test_offline.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import pytest

from kvwire.cluster.vllm_cluster import VLLMServer
from kvwire.cluster.vllm_pd import PDCluster
from tests.vllm.conftest import PROMPTS

openai = pytest.importorskip("openai")

MAX_TOKENS = 24


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


class Answer(NamedTuple):
    text: str
    prompt_tokens: int
    top_logprobs: list[dict[str, float]]
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens not computed
    headers: Mapping[str, str] = {}  # the answer's HTTP headers (a router's x-request-id and x-kvwire-*)


def _cached(usage) -> int | None:
    details = usage.prompt_tokens_details
    return None if details is None else details.cached_tokens


def complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS,
             headers: dict[str, str] | None = None) -> Answer:
    """`prompt` asked as a whole completion (with `headers`, e.g. a trace context); likewise `stream` and `chat`."""
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, logprobs=2, extra_headers=headers)
    out = raw.parse()
    return Answer(out.choices[0].text, out.usage.prompt_tokens, list(out.choices[0].logprobs.top_logprobs),
                  _cached(out.usage), raw.headers)


def stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS,
           headers: dict[str, str] | None = None) -> Answer:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}, extra_headers=headers)
    chunks = list(raw.parse())
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1, "include_usage: one chunk carries the usage"
    return Answer("".join(c.choices[0].text for c in chunks if c.choices), usage[0].prompt_tokens, [],
                  _cached(usage[0]), raw.headers)


def chat(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS,
         headers: dict[str, str] | None = None) -> Answer:
    raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                           max_tokens=max_tokens, temperature=0, extra_headers=headers)
    out = raw.parse()
    return Answer(out.choices[0].message.content or "", out.usage.prompt_tokens, [], _cached(out.usage), raw.headers)


def routed_equals_plain(cluster: PDCluster, plain_server: VLLMServer, model: str) -> None:
    """Every prompt through `cluster`'s router, whole, streamed and as chat, gives the plain server's tokens, and
    the decode server computed none of them itself (what its metrics count while they are asked: it may have
    served before), and each answer's usage says so (cached_tokens: every prompt token) on both of the router's
    paths: it sends the first request's decode step once the prefill server has answered (its params show
    kvwire's connector), every later one's alongside the prefill step (the decode server told the KV's key
    ahead). No prompt of PROMPTS may have been asked of the decode server before."""
    plain = openai_client(plain_server.url)
    before = cluster.prompt_tokens_by_source(), cluster.kv_pulls(), cluster.kv_failed_by_reason()
    routed = openai_client(cluster.router_url)
    sent = 0  # prompt tokens the decode server was asked to continue
    for prompt in PROMPTS:
        got, want = complete(routed, model, prompt), complete(plain, model, prompt)
        assert got.text == want.text
        assert [sorted(t) for t in got.top_logprobs] == [sorted(t) for t in want.top_logprobs]
        for mine, theirs in zip(got.top_logprobs, want.top_logprobs):
            assert mine == pytest.approx(theirs, abs=2e-3)
        streamed = stream(routed, model, prompt)
        assert streamed.text == want.text
        as_chat = chat(routed, model, prompt)
        assert as_chat.text == chat(plain, model, prompt).text
        for answer in (got, streamed, as_chat):  # the first sent after the prefill step, the rest alongside it
            assert answer.cached_tokens == answer.prompt_tokens, "usage says what the decode server did not compute"
        sent += got.prompt_tokens + streamed.prompt_tokens + as_chat.prompt_tokens
    # the decode server has this prompt's first blocks cached (above): only the rest is pulled
    longer = PROMPTS[0] + "And then some more words follow, to make one more block at least. " * 3
    got = complete(routed, model, longer)
    assert got.text == complete(plain, model, longer).text and got.cached_tokens == got.prompt_tokens
    sent += got.prompt_tokens
    by_source = grown_since(before[0], cluster.prompt_tokens_by_source())
    pulls, reasons = cluster.kv_pulls() - before[1], cluster.path_reasons()
    failed = {k: v - before[2].get(k, 0.0) for k, v in cluster.kv_failed_by_reason().items()}
    assert by_source.get("local_compute", 0) == 0, f"decode computed prompt tokens itself: {by_source}"
    assert reasons["prefilled"] == 1 and reasons["prefilled-alongside"] == 3 * len(PROMPTS), reasons
    assert pulls > 0 and set(failed) >= {"deadline", "producer", "mismatch", "transport"}, (pulls, failed)
    assert sum(failed.values()) == 0, f"vLLM's /metrics counts recomputed prompts: {failed}"
    assert by_source.get("external_kv_transfer", 0) > 0 and by_source.get("local_cache_hit", 0) > 0, by_source
    assert by_source["external_kv_transfer"] + by_source["local_cache_hit"] == sent, by_source


def grown_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The series of `after` that grew since `before`, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
