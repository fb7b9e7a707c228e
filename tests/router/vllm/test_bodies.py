"""The bodies the router sends vLLM instances, made from the client's."""

from __future__ import annotations

import json

import pytest

from kvwire.observability.labels import PathReason
from kvwire.router.schemas import APIError
from kvwire.router.vllm.bodies import (
    Endpoint,
    decode_body,
    decode_only_reason,
    kv_transfer_params_of,
    parse_body,
    prefill_body,
)

CLIENT = {"model": "m", "prompt": "Hello", "max_tokens": 64, "min_tokens": 8, "stream": True,
          "stream_options": {"include_usage": True}, "temperature": 0.0, "seed": 3}


def test_prefill_body_asks_one_token_without_stream_and_keeps_the_kv_for_decode():
    body = prefill_body(CLIENT, Endpoint.COMPLETIONS)
    assert body == {"model": "m", "prompt": "Hello", "max_tokens": 1, "n": 1, "stream": False, "temperature": 0.0,
                    "seed": 3, "kv_transfer_params": {"do_remote_decode": True}}
    assert CLIENT["max_tokens"] == 64 and "stream_options" in CLIENT  # the client's body is left as it was


def test_prefill_body_asks_one_choice_the_decode_body_all():
    """n > 1 and best_of would make the prefill instance compute the prompt once per choice, each child holding its
    KV under the one key the router chose; the decode instance's choices start from one prefill."""
    client = {**CLIENT, "n": 4, "best_of": 6}
    body = prefill_body(client, Endpoint.COMPLETIONS, key="k1")
    assert body["n"] == 1 and "best_of" not in body
    assert decode_body(client, {"remote_request_id": "k1"})["n"] == 4


def test_prefill_body_caps_max_completion_tokens_of_chat_only_when_given():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}
    assert prefill_body(chat, Endpoint.CHAT)["max_completion_tokens"] == 1
    assert "max_completion_tokens" not in prefill_body({"model": "m", "messages": []}, Endpoint.CHAT)


def test_a_responses_prefill_body_asks_one_token_stores_nothing_and_runs_in_the_foreground():
    """A stored prefill answer would be one a later turn could name, on an instance that never decodes it."""
    client = {"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 64, "stream": True,
              "store": True, "background": True}
    assert prefill_body(client, Endpoint.RESPONSES) == {
        "model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 1, "stream": False,
        "store": False, "background": False, "kv_transfer_params": {"do_remote_decode": True}}


def test_a_messages_prefill_body_asks_one_token_and_no_choices():
    client = {"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
              "stream": True, "thinking": {"type": "enabled", "budget_tokens": 32}}
    assert prefill_body(client, Endpoint.MESSAGES) == {**client, "max_tokens": 1, "stream": False,
                                                       "kv_transfer_params": {"do_remote_decode": True}}


@pytest.mark.parametrize(("endpoint", "body", "reason"), [
    (Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}, PathReason.BATCHED_PROMPTS),
    (Endpoint.COMPLETIONS, {"prompt": ["a"]}, None),
    (Endpoint.COMPLETIONS, {"prompt": "a", "use_beam_search": True}, PathReason.BEAM_SEARCH),
    (Endpoint.CHAT, {"messages": [], "use_beam_search": True}, PathReason.BEAM_SEARCH),
    (Endpoint.CHAT, {"messages": [], "use_beam_search": False}, None),
    (Endpoint.COMPLETIONS, {"prompt": "a", "prompt_logprobs": 0}, PathReason.PROMPT_LOGPROBS),
    (Endpoint.COMPLETIONS, {"prompt": "a", "echo": True, "logprobs": 1}, PathReason.PROMPT_LOGPROBS),
    (Endpoint.COMPLETIONS, {"prompt": "a", "echo": True}, None),  # vLLM takes no prompt logprobs without logprobs
    (Endpoint.COMPLETIONS, {"prompt": "a", "logprobs": 2, "prompt_logprobs": None}, None),
    (Endpoint.CHAT, {"messages": [], "prompt_logprobs": -1}, PathReason.PROMPT_LOGPROBS),
    (Endpoint.CHAT, {"messages": [], "echo": True}, PathReason.PROMPT_LOGPROBS),  # top_logprobs is 0 by default
    (Endpoint.CHAT, {"messages": [], "echo": True, "top_logprobs": None}, None),
    (Endpoint.CHAT, {"messages": [], "echo": False, "top_logprobs": 3, "logprobs": True}, None),
    (Endpoint.RESPONSES, {"input": "a", "prompt_logprobs": 1}, None),  # vLLM's Responses API has none
    (Endpoint.RESPONSES, {"input": "a", "previous_response_id": "resp_1"}, PathReason.PREVIOUS_RESPONSE),
    (Endpoint.RESPONSES, {"input": "a", "previous_response_id": None}, None),
    (Endpoint.MESSAGES, {"messages": []}, None),
])
def test_what_goes_decode_only_whatever_the_instances_hold(endpoint, body, reason):
    assert decode_only_reason(body, endpoint) == reason


def test_decode_body_is_the_clients_with_the_prefills_params_or_none():
    params = {"do_remote_prefill": True, "remote_engine_id": "e0", "remote_block_ids": [1, 2]}
    assert decode_body(CLIENT, params) == {**CLIENT, "kv_transfer_params": params}
    assert decode_body({**CLIENT, "kv_transfer_params": {"forged": 1}}, None) == CLIENT


def test_kv_transfer_params_come_from_the_top_level_of_the_prefill_answer():
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1"}
    assert kv_transfer_params_of(json.dumps({"choices": [], "kv_transfer_params": params}).encode()) == params
    assert kv_transfer_params_of(b'{"choices": [], "kv_transfer_params": null}') is None  # vLLM with no connector
    assert kv_transfer_params_of(b'{"kv_transfer_params": {}}') is None
    assert kv_transfer_params_of(b"[1, 2]") is None
    assert kv_transfer_params_of(b"not json") is None


def test_the_prefill_servers_cache_hits_do_not_reach_the_decode_server():
    """Given them, vLLM's decode server would report the prefill server's prefix-cache hits as cached_tokens; asked
    alongside, it never gets them: dropped, every path's usage counts what the decode server did not compute."""
    params = {"do_remote_prefill": True, "remote_prefill_cached_tokens": 0}
    got = kv_transfer_params_of(json.dumps({"kv_transfer_params": params}).encode())
    assert got == {"do_remote_prefill": True}


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'"prompt"'])
def test_parse_body_refuses_anything_but_a_json_object(raw):
    with pytest.raises(APIError) as err:
        parse_body(raw)
    assert err.value.status == 400
