"""OpenAI's Responses API over kvwire's nodes (router/responses_api.py): the chat request a Responses request stands
for, what it refuses (naming the field), and bodies and events the official `openai` client's own models read."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvwire.router.responses_api import ResponseShaper, ResponsesRequest, as_chat, renamed
from kvwire.router.schemas import APIError

USAGE = {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
         "prompt_tokens_details": {"cached_tokens": 16}}


def _request(**fields) -> ResponsesRequest:
    return msgspec.convert({"input": "hi", **fields}, type=ResponsesRequest)


def test_instructions_and_input_become_the_chat_messages():
    chat = as_chat(_request(instructions="Be brief.", max_output_tokens=7, temperature=0.0, seed=3, input=[
        {"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "hello"}]}, {"role": "developer", "content": [
                {"type": "input_text", "text": "in French"}]}]))
    plain = [(m.role, m.content if isinstance(m.content, str) else [p.text for p in m.content]) for m in chat.messages]
    assert plain == [("system", "Be brief."), ("user", "hi"), ("assistant", ["hello"]), ("system", ["in French"])]
    assert (chat.max_completion_tokens, chat.temperature, chat.seed, chat.n) == (7, 0.0, 3, 1)
    assert [(m.role, m.content) for m in as_chat(_request()).messages] == [("user", "hi")]


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"), ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"), ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "role": "user", "content": "1"}]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "1"}]}, "input[0].role"),
])
def test_what_is_not_done_is_refused_naming_the_field(fields, param):
    with pytest.raises(APIError) as err:
        as_chat(_request(**fields))
    assert (err.value.status, err.value.param) == (400, param)


def test_store_false_and_the_defaults_are_accepted():
    as_chat(_request(store=False, background=False, tools=[], tool_choice="auto", truncation="disabled",
                     text={"format": {"type": "text"}}, metadata={"k": "v"}, include=[], top_logprobs=0))


def test_a_chat_refusal_names_the_responses_field():
    got = renamed(APIError(400, "max_completion_tokens must be in [1, 4096)", param="max_completion_tokens"))
    assert (got.param, got.message) == ("max_output_tokens", "max_output_tokens must be in [1, 4096)")


def _choice(text: str, finish: str) -> SimpleNamespace:
    return SimpleNamespace(text=text, finish_reason=finish)


def test_the_whole_answer_is_a_response_the_client_reads():
    shaper = ResponseShaper(_request(instructions="Be brief.", max_output_tokens=4, metadata={"k": "v"}), "tiny")
    body = shaper.whole(_choice("abcd", "length"), USAGE, {"path": "disaggregated"})  # type: ignore[arg-type]
    response = Response.model_validate(body)
    assert (response.output_text, response.status, response.incomplete_details.reason) == (
        "abcd", "incomplete", "max_output_tokens")
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (30, 4, 34)
    assert response.usage.input_tokens_details.cached_tokens == 16 and response.metadata == {"k": "v"}
    assert response.model_extra["kvwire"] == {"path": "disaggregated"}
    done = Response.model_validate(shaper.whole(_choice("ab", "stop"), USAGE, {}))  # type: ignore[arg-type]
    assert (done.status, done.incomplete_details) == ("completed", None)


def test_a_stream_is_the_responses_apis_events_in_order():
    shaper = ResponseShaper(_request(), "tiny")
    events = [*shaper.opening(), shaper.delta("ab"), shaper.delta(""), shaper.delta("c"),
              *shaper.closing(_choice("abc", "stop"), USAGE, {"path": "decode-only"})]  # type: ignore[arg-type]
    events = [e for e in events if e is not None]
    read = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in read] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in read] == list(range(len(read)))
    assert read[-1].response.output_text == "abc" and read[-1].response.id == read[0].response.id
    assert read[6].text == "abc" and read[0].response.status == "in_progress"
