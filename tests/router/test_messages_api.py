"""Anthropic's Messages API over kvwire's nodes (router/messages_api.py): the chat request a Messages request stands
for, what it refuses (naming the field), and bodies and events the official `anthropic` client's own models read."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from pydantic import TypeAdapter

from kvwire.router.messages_api import MessageShaper, MessagesRequest, as_chat, count_chat, renamed
from kvwire.router.schemas import APIError

anthropic_types = pytest.importorskip("anthropic.types")
USAGE = {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
         "prompt_tokens_details": {"cached_tokens": 16}}


def _request(**fields) -> MessagesRequest:
    return msgspec.convert({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields},
                           type=MessagesRequest)


def test_system_and_messages_become_the_chat_messages():
    chat = as_chat(_request(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.",
                                                                     "cache_control": {"type": "ephemeral"}}],
                            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
                                {"type": "text", "text": "hello"}]}, {"role": "user", "content": "bye"}],
                            stop_sequences=["\n\n"], temperature=0.0, top_k=5, metadata={"user_id": "u1"}))
    plain = [(m.role, m.content if isinstance(m.content, str) else [p.text for p in m.content]) for m in chat.messages]
    assert plain == [("system", "Be brief."), ("user", "hi"), ("assistant", ["hello"]), ("user", "bye")]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.top_p, chat.user) == (
        8, ["\n\n"], 0.0, 5, 1.0, "u1")
    assert count_chat(_request(max_tokens=None)).messages[0].content == "hi"  # count_tokens needs no max_tokens


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"), ({"tools": [{"name": "f", "input_schema": {}}]}, "tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"), ({"thinking": {"type": "enabled", "budget_tokens": 9}},
                                                         "thinking"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content"),
    ({"system": [{"type": "document"}]}, "system"),
])
def test_what_is_not_done_is_refused_naming_the_field(fields, param):
    with pytest.raises(APIError) as err:
        as_chat(_request(**fields))
    assert (err.value.status, err.value.param) == (400, param)


def test_a_chat_refusal_names_the_messages_field():
    assert renamed(APIError(400, "at most 16 stop strings", param="stop")).param == "stop_sequences"


def _choice(text: str, finish: str, stop: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(text=text, finish_reason=finish, stop_reason=stop)


@pytest.mark.parametrize(("choice", "reason", "sequence"), [
    (_choice("ab", "length"), "max_tokens", None), (_choice("ab", "stop"), "end_turn", None),
    (_choice("ab", "stop", "\n\n"), "stop_sequence", "\n\n")])
def test_the_whole_answer_is_a_message_the_client_reads(choice, reason, sequence):
    body = MessageShaper(_request(), "tiny", 30).whole(choice, USAGE, {"path": "disaggregated"})
    message = anthropic_types.Message.model_validate(body)
    assert (message.content[0].text, message.stop_reason, message.stop_sequence) == ("ab", reason, sequence)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        14, 16, 4), "Anthropic's input_tokens leave out the cached ones"
    assert message.model_extra["kvwire"] == {"path": "disaggregated"}


def test_a_stream_is_the_messages_apis_events_in_order():
    shaper = MessageShaper(_request(), "tiny", 30)
    events = [*shaper.opening(), shaper.delta("ab"), shaper.delta(""), shaper.delta("c"),
              *shaper.closing(_choice("abc", "stop", "x"), USAGE, {})]  # type: ignore[arg-type]
    events = [e for e in events if e is not None]
    assert [e["type"] for e in events][:3] == ["message_start", "content_block_start", "ping"]
    read = [TypeAdapter(anthropic_types.RawMessageStreamEvent).validate_python(e) for e in events
            if e["type"] != "ping"]  # the client reads a ping apart from the others
    assert [e.type for e in read] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert read[0].message.usage.input_tokens == 30 and read[0].message.id == shaper.id
    assert "".join(e.delta.text for e in read if e.type == "content_block_delta") == "abc"
    assert (read[5].delta.stop_reason, read[5].delta.stop_sequence, read[5].usage.output_tokens) == (
        "stop_sequence", "x", 4)


def test_errors_come_in_anthropics_shape():
    body = MessageShaper.error_body(APIError(400, "tools are not supported", param="tools"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "tools are not supported"}}
