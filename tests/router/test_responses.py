"""Answer bodies: completions' top_logprobs name the sampled token first, as OpenAI's and vLLM's do."""

from __future__ import annotations

import json

from kvwire.engine.tokenizer import ByteTokenizer
from kvwire.protocol.work import TokenChunk, TokenLogprobs
from kvwire.router.choice import Choice
from kvwire.router.responses import Api, Shaper
from kvwire.router.sampling import Limits, completion_plan
from kvwire.router.schemas import CompletionRequest, parse_body

LIMITS = Limits(max_model_len=64, vocab_size=300)


def _top_logprobs(logprobs: int, chunk: TokenChunk) -> list[dict[str, float]]:
    req = parse_body(json.dumps({"prompt": "x", "max_tokens": 2, "logprobs": logprobs}).encode(), CompletionRequest,
                     lenient=False)
    plan = completion_plan(req, [[1]], LIMITS)
    tokenizer = ByteTokenizer()
    choice = Choice(0, "r", [1], plan, tokenizer)
    choice.add(chunk)
    body = Shaper(Api.COMPLETIONS, "r", "m", plan, tokenizer).whole([choice], usage={}, kvwire={})
    return body["choices"][0]["logprobs"]["top_logprobs"]


def test_sampled_token_leads_and_is_not_repeated():
    a, b, c = ord("a"), ord("b"), ord("c")
    chunk = TokenChunk("r", [a, c], finished=True, finish_reason="length",
                       logprobs=[TokenLogprobs(-0.5, [a], [-0.5]), TokenLogprobs(-3.0, [b], [-0.1])])
    # logprobs=1: the top one, and the sampled one when it is not the top (logprobs + 1 entries at most)
    assert _top_logprobs(1, chunk) == [{"a": -0.5}, {"c": -3.0, "b": -0.1}]
    assert list(_top_logprobs(1, chunk)[1]) == ["c", "b"]


def test_logprobs_zero_still_names_the_sampled_token():
    chunk = TokenChunk("r", [ord("z")], finished=True, finish_reason="length",
                       logprobs=[TokenLogprobs(-1.25, [], [])])
    assert _top_logprobs(0, chunk) == [{"z": -1.25}]


def test_usage_counts_a_prompts_cached_tokens_once_however_many_choices():
    from types import SimpleNamespace

    from kvwire.protocol.work import DecodeStats
    from kvwire.router.app import _usage

    def choice(index: int, cached: int) -> SimpleNamespace:
        stats = DecodeStats(bypassed=True, transport="shm", kv_bytes=1, transfer_ms=0.1, ttft_ms=1.0,
                            prefill_node="p", decode_node="d", cached_tokens=cached)
        return SimpleNamespace(index=index, token_ids=[1, 2], stats=stats)

    # two prompts (10 and 20 tokens), two choices each: each prompt's first choice says what was cached
    gen = SimpleNamespace(plan=SimpleNamespace(prompts=[[0] * 10, [0] * 20], best_of=2),
                          choices=[choice(0, 8), choice(1, 8), choice(2, 16), choice(3, 0)])
    usage = _usage(gen)  # type: ignore[arg-type]
    assert usage["prompt_tokens"] == 30 and usage["completion_tokens"] == 8
    assert usage["prompt_tokens_details"] == {"cached_tokens": 24}
