"""The bodies the router sends vLLM instances, each made from the client's body as vLLM accepts it.

The client's body is vLLM's to check: the router reads only what it must change, and builds
each body it sends as a new dict, leaving every other field as the client wrote it.
"""

from __future__ import annotations

import enum
import json
from typing import Any, NamedTuple

from kvwire.connectors.vllm.params import KEY, TRANSFER
from kvwire.observability.labels import PathReason
from kvwire.router.schemas import APIError

KV_TRANSFER_PARAMS = "kv_transfer_params"
# Fields the prefill body leaves out: stream_options is refused without stream, a min_tokens above the
# prefill's max_tokens of 1 would be refused too, and best_of (like n, which it sets to 1) would make the
# prefill instance compute the prompt once per choice: the decode instance's choices start from one prefill.
_NOT_FOR_PREFILL = frozenset({"stream_options", "min_tokens", "best_of", KV_TRANSFER_PARAMS})


class Endpoint(enum.StrEnum):
    """The generation endpoints the router passes on, by path: each carries vLLM's kv_transfer_params both ways."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"  # OpenAI's Responses API
    MESSAGES = "/v1/messages"  # Anthropic's Messages API


# Each endpoint's field for the most tokens an answer may generate (a chat body may give either of two).
_MAX_TOKENS = {Endpoint.COMPLETIONS: ("max_tokens",), Endpoint.CHAT: ("max_tokens", "max_completion_tokens"),
               Endpoint.RESPONSES: ("max_output_tokens",), Endpoint.MESSAGES: ("max_tokens",)}
# What the Responses API's prefill body sets besides: no stored answer (a decode instance's answer is the one a
# later turn names) and no background run (the router reads its answer's params at once).
_RESPONSES_PREFILL = {"store": False, "background": False}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The client's body as a JSON object.

    Raises:
        APIError(400): the body is not JSON, or not an object.
    """
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "body must be a JSON object")
    return body


def is_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


class Producer(NamedTuple):
    """What a decode instance must know of a prefill instance's KvwireConnector to wait for its KV before it
    answers: its tensor-parallel size (each rank holds its share under its own key)."""

    tp_size: int


def prefill_body(body: dict[str, Any], endpoint: Endpoint, key: str | None = None) -> dict[str, Any]:
    """The body a prefill instance gets: one choice of one token, no stream, and its KV kept for a decode
    instance (under the directory key `key` when the router chose one: the decode instance is told it ahead,
    `ahead_params`)."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    params: dict[str, Any] = {"do_remote_decode": True} | ({KEY: key} if key is not None else {})
    first, *others = _MAX_TOKENS[endpoint]
    out.update({first: 1} | {k: 1 for k in others if k in body}, stream=False, kv_transfer_params=params)
    if endpoint in (Endpoint.COMPLETIONS, Endpoint.CHAT):
        out["n"] = 1
    if endpoint == Endpoint.RESPONSES:
        out.update(_RESPONSES_PREFILL)
    return out


def decode_only_reason(body: dict[str, Any], endpoint: Endpoint) -> PathReason | None:
    """Why the client's body goes decode-only whatever the instances hold; None: it may be disaggregated.

    A batch of prompts: vLLM's prefill answer carries one prompt's kv_transfer_params, which every prompt's request
    on the decode instance would name. Beam search: vLLM's answers none. Prompt logprobs: vLLM computes the prompt
    whole on the decode instance, reading no KV of it. A Responses turn naming an earlier one: the earlier turns are
    stored on the decode instance that answered them, not on a prefill instance.
    """
    if endpoint == Endpoint.COMPLETIONS and batched(body):
        return PathReason.BATCHED_PROMPTS
    if endpoint in (Endpoint.COMPLETIONS, Endpoint.CHAT) and body.get("use_beam_search") is True:
        return PathReason.BEAM_SEARCH
    if prompt_logprobs(body, endpoint):
        return PathReason.PROMPT_LOGPROBS
    if endpoint == Endpoint.RESPONSES and body.get("previous_response_id"):
        return PathReason.PREVIOUS_RESPONSE
    return None


def prompt_logprobs(body: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether vLLM computes the body's prompt logprobs: `prompt_logprobs`, or `echo` with the logprobs that vLLM
    then takes for them (completions: `logprobs`; chat: `top_logprobs`, 0 by default)."""
    if endpoint not in (Endpoint.COMPLETIONS, Endpoint.CHAT):
        return False
    echoed = body.get("logprobs") if endpoint == Endpoint.COMPLETIONS else body.get("top_logprobs", 0)
    return body.get("prompt_logprobs") is not None or bool(body.get("echo")) and echoed is not None


def batched(body: dict[str, Any]) -> bool:
    """Whether the body is a completions request of several prompts (texts or token-id lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt)


def choices(body: dict[str, Any]) -> int:
    """How many choices the client's body asks vLLM to generate: its n, or best_of when larger."""
    asked = [v for k in ("n", "best_of") if isinstance(v := body.get(k), int) and not isinstance(v, bool)]
    return max([1, *asked])


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body for a decode instance, with the prefill's `kv_transfer_params`
    (None: none, the decode instance computes the prompt itself)."""
    out = {k: v for k, v in body.items() if k != KV_TRANSFER_PARAMS}
    if kv_transfer_params is not None:
        out[KV_TRANSFER_PARAMS] = kv_transfer_params
    return out


def ahead_params(key: str, producer: Producer) -> dict[str, Any]:
    """The kv_transfer_params of a decode instance sent a request at the same time as a prefill instance that
    holds its KV under `key` (connectors/vllm/params.py, "announced ahead")."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": key,
            "remote_tp_size": producer.tp_size, "transfer": TRANSFER}


def producer_of(params: dict[str, Any] | None) -> Producer | None:
    """The KvwireConnector producer a prefill instance's kv_transfer_params show; None for another connector."""
    if not params or params.get("transfer") != TRANSFER:
        return None
    tp = params.get("remote_tp_size", 1)
    return Producer(tp) if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else None


# vLLM's prefill scheduler adds its own prefix-cache hits to the params it answers, and a decode instance given
# them reports those as the answer's `usage.prompt_tokens_details.cached_tokens` instead of its own count. A
# decode instance asked alongside the prefill step never gets them. Dropped, so that on every path the answer
# counts what the decode instance did not compute: the tokens whose KV it pulled, and its own prefix-cache hits.
PREFILL_CACHE_HITS = "remote_prefill_cached_tokens"


def kv_transfer_params_of(response: bytes) -> dict[str, Any] | None:
    """The top-level `kv_transfer_params` object of a prefill instance's JSON answer, for the decode instance
    (without PREFILL_CACHE_HITS); None when there is none (a vLLM started without a KV connector answers null)
    or it is not JSON."""
    try:
        params = json.loads(response).get(KV_TRANSFER_PARAMS)
    except (ValueError, AttributeError):
        return None
    if not isinstance(params, dict) or not params:
        return None
    params.pop(PREFILL_CACHE_HITS, None)
    return params

