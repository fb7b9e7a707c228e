"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over kvwire's nodes, as a chat request
and a Message body (vLLM serves the same API).

A request's life (router/app.py runs it):

1. `parse_body` reads a `MessagesRequest`: a field kvwire does not know is refused (or, `--lenient`, dropped).
2. `as_chat` makes it the chat request it stands for: `system` (a text, or text blocks joined) as the system
   message, then `messages` (user and assistant turns of a text or text blocks), `max_tokens`,
   `stop_sequences` as stop strings. Refused with a 400 naming the field: tools, extended thinking, and any
   block that is not text (images, documents, tool use and results). `cache_control` marks are accepted: the
   prefix caches key blocks by their tokens and need no marking.
3. The chat request runs as any other (one choice).
4. `MessageShaper` answers it as a Message (`stop_reason` end_turn, max_tokens or stop_sequence; usage as
   Anthropic counts it: `input_tokens` without the ones read from the decode node's prefix cache, which are
   `cache_read_input_tokens`), with kvwire's `kvwire` report beside it; streamed, as the API's events
   (message_start, content_block_start, ping, a text delta per chunk, content_block_stop, message_delta,
   message_stop). Errors come in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from kvwire.router.api_adapter import ChatAdapter
from kvwire.router.choice import Choice
from kvwire.router.schemas import APIError, ChatMessage, ChatRequest, ContentPart


class Block(msgspec.Struct, kw_only=True):
    type: str  # "text" is served; another block is refused
    text: str | None = None
    cache_control: dict[str, Any] | None = None  # accepted: the prefix caches need no marking


class Turn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[Block]


class MessagesRequest(msgspec.Struct, kw_only=True):
    """Anthropic's Messages request fields, then kvwire's (module docstring)."""

    model: str | None = None
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    messages: list[Turn]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None  # None: 1.0, as Anthropic
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: accepted, kvwire keeps no per-user state
    tools: list[dict[str, Any]] | None = None  # refused unless empty
    tool_choice: dict[str, Any] | None = None  # only {"type": "auto"} or {"type": "none"} (with no tools)
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}
    service_tier: str | None = None  # only "auto" or "standard_only"
    # kvwire's
    disaggregate: bool = True


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


def as_chat(req: MessagesRequest) -> ChatRequest:
    """The chat request `req` stands for (module docstring, step 2). Raises APIError(400)."""
    _require(req.max_tokens is not None, "max_tokens", "max_tokens is required")
    return _chat(req)


def count_chat(req: MessagesRequest) -> ChatRequest:
    """The chat request whose prompt /v1/messages/count_tokens counts (no max_tokens needed)."""
    return _chat(req)


def _chat(req: MessagesRequest) -> ChatRequest:
    _require(not req.tools, "tools", "tools are not supported")
    _require(req.tool_choice is None or req.tool_choice.get("type") in ("auto", "none"), "tool_choice",
             "tool_choice needs tools, which are not supported")
    _require(req.thinking is None or req.thinking.get("type") == "disabled", "thinking",
             "extended thinking is not supported")
    _require(req.service_tier in (None, "auto", "standard_only"), "service_tier", "only service_tier \"auto\"")
    _require(bool(req.messages), "messages", "messages must not be empty")
    system = req.system if isinstance(req.system, str) or req.system is None else \
        "".join(_text(b, "system") for b in req.system)
    lead = [ChatMessage(role="system", content=system)] if system else []
    turns = [_turn(t, i) for i, t in enumerate(req.messages)]
    return ChatRequest(model=req.model, messages=lead + turns, max_tokens=req.max_tokens, stream=req.stream,
                       temperature=req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
                       top_k=req.top_k or 0, stop=req.stop_sequences, disaggregate=req.disaggregate,
                       user=(req.metadata or {}).get("user_id"))


def _text(block: Block, param: str) -> str:
    _require(block.type == "text" and block.text is not None, param,
             f"content blocks of type {block.type!r} are not supported (text only)")
    assert block.text is not None
    return block.text


def _turn(turn: Turn, i: int) -> ChatMessage:
    _require(turn.role in ("user", "assistant"), f"messages[{i}].role", f"role {turn.role!r} is not user or "
                                                                         "assistant")
    if isinstance(turn.content, str):
        return ChatMessage(role=turn.role, content=turn.content)
    texts = [_text(b, f"messages[{i}].content") for b in turn.content]
    return ChatMessage(role=turn.role, content=[ContentPart(type="text", text=t) for t in texts])


def renamed(exc: APIError) -> APIError:
    """A refusal of the chat request `as_chat` made, naming the Messages request's field."""
    if exc.param == "stop":
        return APIError(exc.status, exc.message.replace("stop", "stop_sequences"), type_=exc.type,
                        param="stop_sequences", code=exc.code)
    return exc


class MessageShaper:
    """One request's Message body, whole or as the Messages API's stream of events."""

    def __init__(self, req: MessagesRequest, model: str, prompt_tokens: int = 0):
        self.req = req
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    def whole(self, choice: Choice, usage: dict, kvwire: dict) -> dict:
        """The non-streamed answer."""
        stop_reason, stop_sequence = _stop(choice)
        return {**self._message([{"type": "text", "text": choice.text}], _usage(usage)), "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "kvwire": kvwire}

    def opening(self) -> list[dict]:
        """A stream's first events, before any text."""
        start = self._message([], {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        return [{"type": "message_start", "message": {**start, "stop_reason": None, "stop_sequence": None}},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                {"type": "ping"}]

    def delta(self, text: str) -> dict | None:
        """The event of `text` added to the answer; None for none."""
        if not text:
            return None
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}

    def closing(self, choice: Choice, usage: dict, kvwire: dict) -> list[dict]:
        """A stream's last events: the block stopped, the message's stop reason and usage, the message stopped."""
        stop_reason, stop_sequence = _stop(choice)
        return [{"type": "content_block_stop", "index": 0},
                {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 "usage": _usage(usage), "kvwire": kvwire},
                {"type": "message_stop"}]

    def error(self, exc: APIError) -> dict:
        """The event of an error that ended a stream."""
        return self.error_body(exc)

    @staticmethod
    def error_body(exc: APIError) -> dict:
        kind = "invalid_request_error" if exc.status == 400 else "not_found_error" if exc.status == 404 else \
            "overloaded_error" if exc.status == 503 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": exc.message}}

    def _message(self, content: list[dict], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "usage": usage}


def _stop(choice: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished choice."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _usage(chat: dict) -> dict:
    """Anthropic's usage from the chat answer's: input_tokens leaves out those read from a prefix cache."""
    cached = chat["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat["prompt_tokens"] - cached, "output_tokens": chat["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


MESSAGES = ChatAdapter(MessagesRequest, as_chat, renamed, MessageShaper)
