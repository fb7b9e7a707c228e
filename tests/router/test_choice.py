"""A choice's text, cut at stop strings wherever the decode node's chunks split, and held back while streaming."""

from __future__ import annotations

import pytest

from kvwire.engine.tokenizer import ByteTokenizer
from kvwire.protocol.work import SamplingParams, TokenChunk, TokenLogprobs
from kvwire.router.choice import Choice
from kvwire.router.sampling import Plan

TEXT = "Hello world. Bye"


def _choice(stop=(), include=False, min_tokens=0, logprobs=None) -> Choice:
    plan = Plan(prompts=[[1]], n=1, best_of=1, stop=tuple(stop), include_stop=include,
                sampling=SamplingParams(max_tokens=64, min_tokens=min_tokens, logprobs=logprobs))
    return Choice(0, "r", [1], plan, ByteTokenizer())


def _feed(choice: Choice, text: str, split: list[int]) -> list[bool]:
    ids, out, start = list(text.encode()), [], 0
    for end in [*split, len(ids)]:
        out.append(choice.add(TokenChunk(request_id="r", token_ids=ids[start:end], finished=end == len(ids),
                                         finish_reason="length")))
        start = end
        if choice.finished:
            break
    return out


@pytest.mark.parametrize("split", [[], [3], [5, 6, 7], list(range(1, len(TEXT)))], ids=str)
def test_stop_string_cuts_text_and_tokens_wherever_chunks_split(split):
    choice = _choice(stop=["d. B", "zzz"])
    assert True in _feed(choice, TEXT, split)  # the node must be told to stop
    assert choice.text == "Hello worl" and choice.finish_reason == "stop" and choice.stop_reason == "d. B"
    assert bytes(choice.token_ids).decode() == "Hello world. B"  # up to the token that completed the stop


def test_include_stop_str_and_no_match():
    choice = _choice(stop=["world"], include=True)
    _feed(choice, TEXT, [])
    assert choice.text == "Hello world"
    other = _choice(stop=["nope"])
    assert _feed(other, TEXT, [4]) == [False, False]
    assert other.text == TEXT and other.finish_reason == "length" and other.stop_reason is None


def test_stop_strings_wait_for_min_tokens():
    choice = _choice(stop=["l"], min_tokens=5)
    _feed(choice, TEXT, [])
    assert choice.text == "Hello wor"  # the "l"s of "Hello" are tokens 3 and 4 of the 5 without stops


def test_streaming_holds_back_a_possible_stop_and_partial_utf8():
    choice = _choice(stop=["world!"])
    choice.add(TokenChunk(request_id="r", token_ids=list(b"Hi wor")))
    assert choice.stream_delta()[0] == "Hi "  # "wor" may begin the stop string
    choice.add(TokenChunk(request_id="r", token_ids=list(b"ld") + [0xC3]))  # half of "é"
    assert choice.stream_delta()[0] == ""  # "world" still may; the half character is held
    choice.add(TokenChunk(request_id="r", token_ids=[0xA9], finished=True, finish_reason="length"))
    assert choice.stream_delta()[0] == "worldé" and choice.text == "Hi worldé"


def test_offsets_and_logprobs_follow_tokens():
    choice = _choice(logprobs=1)
    lps = [TokenLogprobs(-0.5, [72], [-0.5]), TokenLogprobs(-1.0, [1], [-0.1])]
    choice.add(TokenChunk(request_id="r", token_ids=list(b"Hi"), logprobs=lps, finished=True, finish_reason="stop"))
    assert choice.offsets == [0, 1] and choice.logprobs == lps and choice.total_logprob() == -1.5
