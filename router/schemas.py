"""OpenAI completions and chat-completions request shapes, and OpenAI-style errors.

Every field listed here is either applied (router/sampling.py says how) or refused there with
a 400 naming it; a field that is not listed is refused too, unless the router runs `--lenient`.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec

log = logging.getLogger(__name__)
Stop = str | list[str] | None
R = TypeVar("R", bound=msgspec.Struct)


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (refused)


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields completions and chat share: OpenAI's, then vLLM's extensions, then kvwire's."""

    model: str | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # refused unless empty
    user: str | None = None  # accepted; kvwire keeps no per-user state
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False refused
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    # kvwire's
    return_token_ids: bool = False
    disaggregate: bool = True  # False: the decode node computes the prompt itself (no prefill node, no transfer)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int | list[int]]  # a text, token ids, or a list of either (router/app.py)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None  # refused unless empty


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # only "text" is served (an image part's other fields are not read: the part is refused)
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # what a client replaying an earlier answer's message sends: accepted when empty, refused otherwise
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # only {"type": "text"}
    tools: list[dict[str, Any]] | None = None  # refused unless empty
    tool_choice: str | None = None  # only "none" or "auto" (with no tools)
    parallel_tool_calls: bool | None = None  # nothing to parallelise without tools
    echo: bool = False  # vLLM's: refused
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(body: bytes, kind: type[R], lenient: bool) -> R:
    """Decode a request of `kind`. Raises APIError(400) for bad JSON, bad types, or fields kvwire does not
    know (only logged, and dropped, when `lenient`)."""
    try:
        raw = msgspec.json.decode(body, type=dict)
    except msgspec.ValidationError:
        raise APIError(400, "body must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep to be a request
        raise APIError(400, f"body is not valid JSON: {exc}") from None
    unknown = sorted(set(raw) - set(kind.__struct_fields__))
    if unknown:
        if not lenient:
            raise APIError(400, f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} (kvwire "
                                "does not apply them; start the router with --lenient to ignore them)",
                           param=unknown[0])
        log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        raw = {k: v for k, v in raw.items() if k not in unknown}
    try:
        return msgspec.convert(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}") from None
