"""What the router asks vLLM's /tokenize (or render endpoints) for a client's body, and what it reads of an answer's
usage."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from kvwire.observability.metrics import Metrics
from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.tokens import (
    RENDER_RETRY_S,
    Ask,
    PromptReader,
    TokenizeFailed,
    completion_tokens_of,
    prompt_tokens,
    tokenize_body,
)


def test_a_chat_body_is_tokenized_with_every_field_that_changes_its_prompt():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 5,
            "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.0}
    assert tokenize_body(Endpoint.CHAT, body) == Ask("/tokenize", {
        "model": "m", "messages": body["messages"], "tools": [], "chat_template_kwargs": {"enable_thinking": False}})
    assert tokenize_body(Endpoint.CHAT, {"model": "m"}) is None


def test_a_completion_prompt_is_tokenized_and_token_ids_are_taken_as_they_are():
    assert tokenize_body(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hi", "add_special_tokens": False}) == Ask(
        "/tokenize", {"model": "m", "prompt": "hi", "add_special_tokens": False})
    assert tokenize_body(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["hi"]}) == Ask(
        "/tokenize", {"model": "m", "prompt": "hi"})
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": [[1, 2, 3]]}) == [1, 2, 3]
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}) is None  # a batch: no one prompt
    assert tokenize_body(Endpoint.COMPLETIONS, {"prompt": [True, 2]}) is None


def test_a_plain_responses_or_messages_body_is_tokenized_as_the_chat_vllm_renders_it_from():
    """Texts alone, as vLLM's Responses (instructions, then input) and Messages (system, then messages) APIs build
    their chat; tests/vllm/test_pd_schedule.py checks the counts against vLLM's own usage."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, *turns]}
    assert tokenize_body(Endpoint.RESPONSES, {"model": "m", "input": "hi"}) == Ask(
        "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert tokenize_body(Endpoint.RESPONSES, {"model": "m", "instructions": "Be brief.", "max_output_tokens": 3,
                                              "input": [turns[0], {"type": "message", **turns[1]}]}) == Ask(
        "/tokenize", chat)
    assert tokenize_body(Endpoint.MESSAGES, {"model": "m", "system": "Be brief.", "messages": turns,
                                             "max_tokens": 5}) == Ask("/tokenize", chat)


@pytest.mark.parametrize(("endpoint", "body"), [
    (Endpoint.RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}),
    (Endpoint.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    (Endpoint.RESPONSES, {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}),
    (Endpoint.MESSAGES, {"messages": [{"role": "system", "content": "inline"}]}),  # vLLM may merge it
    (Endpoint.MESSAGES, {"system": [{"type": "text", "text": "s"}], "messages": []}),
    (Endpoint.MESSAGES, {"messages": "hi"}),
])
def test_a_body_that_is_not_texts_alone_is_rendered_by_the_instance(endpoint, body):
    """Tools, content blocks, tool calls and results: vLLM's render endpoint of the API renders the client's body
    as the API itself does."""
    assert tokenize_body(endpoint, body) == Ask(f"{endpoint.value}/render", body, "token_ids")


def test_a_turn_after_a_stored_response_is_not_tokenized():
    assert tokenize_body(Endpoint.RESPONSES, {"input": "hi", "previous_response_id": "resp_1"}) is None


def test_the_tokens_an_answer_generated_come_from_its_usage_when_it_has_one_choice_or_is_a_message():
    def answer(choices: int, usage: object) -> bytes:
        return json.dumps({"choices": [{}] * choices, "usage": usage}).encode()

    assert completion_tokens_of(answer(1, {"completion_tokens": 7})) == 7
    assert completion_tokens_of(answer(2, {"completion_tokens": 7})) == 0
    assert completion_tokens_of(answer(1, None)) == 0
    assert completion_tokens_of(b"not json") == 0
    assert completion_tokens_of(json.dumps({"type": "message", "usage": {"input_tokens": 9, "output_tokens": 4}})
                                .encode()) == 4  # a Message's, or a Response's
    assert completion_tokens_of(json.dumps({"object": "response", "usage": None}).encode()) == 0


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


TOOLS_BODY = {"model": "m", "system": [{"type": "text", "text": "s"}], "messages": [{"role": "user", "content": "x"}]}


def test_an_instance_without_render_endpoints_places_by_load_and_is_not_asked_again_for_a_while():
    """Without --enable-scale-out vLLM answers its render endpoints 403: the prompt goes unknown (counted), the
    reason names the flag, and that instance is asked again only after RENDER_RETRY_S; /tokenize asks go on."""
    asked: list[str] = []
    render_on = False

    def answer(request: httpx2.Request) -> httpx2.Response:
        asked.append(request.url.path)
        if request.url.path == "/v1/messages/render":
            return httpx2.Response(200, json={"token_ids": [5, 6, 7]}) if render_on else httpx2.Response(403)
        return httpx2.Response(200, json={"tokens": [1, 2]})

    now = [100.0]
    metrics = Metrics()
    reader = PromptReader(metrics, clock=lambda: now[0])

    async def read(body: dict) -> list[int] | None:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(answer)) as client:
            return await reader.read(client, "r1", ["http://d:1"], Endpoint.MESSAGES, body, {})

    assert asyncio.run(read(TOOLS_BODY)) is None
    assert asyncio.run(read(TOOLS_BODY)) is None  # not asked: counted all the same
    assert asyncio.run(read({"model": "m", "messages": [{"role": "user", "content": "x"}]})) == [1, 2]
    assert asked == ["/v1/messages/render", "/tokenize"]
    assert metrics.registry.get_sample_value("kvwire_vllm_tokenize_failures_total") == 2
    render_on, now[0] = True, now[0] + RENDER_RETRY_S + 1  # restarted with --enable-scale-out
    assert asyncio.run(read(TOOLS_BODY)) == [5, 6, 7]


def test_a_render_refusal_names_the_flag():
    async def ask() -> list[int] | None:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(lambda _: httpx2.Response(403))) as client:
            return await prompt_tokens(client, "r1", "http://d:1", Endpoint.MESSAGES, TOOLS_BODY, {})

    with pytest.raises(TokenizeFailed, match="/v1/messages/render answered 403: .*--enable-scale-out") as caught:
        asyncio.run(ask())
    assert caught.value.no_render
