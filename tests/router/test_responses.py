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
