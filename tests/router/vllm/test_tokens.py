"""What the router asks vLLM's /tokenize for a client's body, and what it reads of an answer's usage."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.tokens import TokenizeFailed, completion_tokens_of, prompt_tokens, tokenize_body


def test_a_chat_body_is_tokenized_with_every_field_that_changes_its_prompt():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 5,
            "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.0}
    assert tokenize_body(Endpoint.CHAT, body) == {"model": "m", "messages": body["messages"], "tools": [],
                                                  "chat_template_kwargs": {"enable_thinking": False}}
    assert tokenize_body(Endpoint.CHAT, {"model": "m"}) is None


def test_a_completion_prompt_is_tokenized_and_token_ids_are_taken_as_they_are():
    assert tokenize_body(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hi", "add_special_tokens": False}) == {
        "model": "m", "prompt": "hi", "add_special_tokens": False}
    assert tokenize_body(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["hi"]}) == {"model": "m", "prompt": "hi"}
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": [[1, 2, 3]]}) == [1, 2, 3]
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}) is None  # a batch: no one prompt
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": [True, 2]}) is None


def test_a_plain_responses_or_messages_body_is_tokenized_as_the_chat_vllm_renders_it_from():
    """Texts alone, as vLLM's Responses (instructions, then input) and Messages (system, then messages) APIs build
    their chat; tests/vllm/test_pd_schedule.py checks the counts against vLLM's own usage."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, *turns]}
    assert tokenize_body(Endpoint.RESPONSES, {"model": "m", "input": "hi"}) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert tokenize_body(Endpoint.RESPONSES, {"model": "m", "instructions": "Be brief.", "max_output_tokens": 3,
                                              "input": [turns[0], {"type": "message", **turns[1]}]}) == chat
    assert tokenize_body(Endpoint.MESSAGES, {"model": "m", "system": "Be brief.", "messages": turns,
                                             "max_tokens": 5}) == chat


@pytest.mark.parametrize(("endpoint", "body"), [
    (Endpoint.RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}),
    (Endpoint.RESPONSES, {"input": "hi", "previous_response_id": "resp_1"}),  # the earlier turns are not here
    (Endpoint.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    (Endpoint.RESPONSES, {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}),
    (Endpoint.MESSAGES, {"messages": [{"role": "system", "content": "inline"}]}),  # vLLM may merge it
    (Endpoint.MESSAGES, {"system": [{"type": "text", "text": "s"}], "messages": []}),
    (Endpoint.MESSAGES, {"messages": "hi"}),
])
def test_a_body_whose_prompt_the_router_cannot_tell_is_not_tokenized(endpoint, body):
    assert tokenize_body(endpoint, body) is None


def test_the_tokens_an_answer_generated_come_from_its_usage_when_it_has_one_choice():
    def answer(choices: int, usage: object) -> bytes:
        return json.dumps({"choices": [{}] * choices, "usage": usage}).encode()

    assert completion_tokens_of(answer(1, {"completion_tokens": 7})) == 7
    assert completion_tokens_of(answer(2, {"completion_tokens": 7})) == 0
    assert completion_tokens_of(answer(1, None)) == 0
    assert completion_tokens_of(b"not json") == 0


def test_a_prompt_an_instance_does_not_tokenize_raises_and_names_it():
    def answer(request: httpx2.Request) -> httpx2.Response:
        prompt = json.loads(request.content)["prompt"]
        return httpx2.Response(200, json={"tokens": [1, 2]}) if prompt == "ok" else httpx2.Response(404)

    async def ask(prompt: object) -> list[int] | None:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(answer)) as client:
            return await prompt_tokens(client, "r1", "http://d:1", Endpoint.COMPLETIONS, {"prompt": prompt}, {})

    assert asyncio.run(ask("ok")) == [1, 2]
    assert asyncio.run(ask(["a", "b"])) is None  # a batch: no one prompt, nothing asked
    with pytest.raises(TokenizeFailed, match="request r1: vLLM instance http://d:1 .* answered 404"):
        asyncio.run(ask("missing"))
