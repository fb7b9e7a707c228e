"""OpenAI's Responses API (POST /v1/responses) over kvwire's nodes, as a chat request and a Response body.

A request's life (router/app.py runs it):

1. `parse_body` reads a `ResponsesRequest`: a field kvwire does not know is refused (or, `--lenient`, dropped).
2. `as_chat` makes it the chat request it stands for: `instructions` as the system message, then `input` (a text:
   one user message; or messages of text parts, a developer's as a system message), `max_output_tokens` as
   `max_completion_tokens`. Everything else is applied the chat way (router/sampling.py) or refused here with a
   400 naming it: nothing is stored (no `store: true`, no `previous_response_id`, no `background`), no tools, no
   reasoning, text format "text" only, no logprobs.
3. The chat request runs as any other (one choice).
4. `ResponseShaper` answers it as a Response object, with kvwire's `kvwire` report beside its fields; streamed,
   as the Responses API's events (created, in_progress, the output item and text part added, a text delta per
   chunk, then the text, part and item done, and completed: its response's status "incomplete" when
   max_output_tokens ended it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from kvwire.router.api_adapter import ChatAdapter
from kvwire.router.choice import Choice
from kvwire.router.schemas import APIError, ChatMessage, ChatRequest, ContentPart, Stop

# the roles of an input message, as chat's: a developer's instructions are a system message there
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


class InputPart(msgspec.Struct, kw_only=True):
    type: str  # input_text or output_text are served (an image or file part is refused)
    text: str | None = None


class InputMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[InputPart]
    type: str = "message"  # a function call or its output is refused


class TextFormat(msgspec.Struct, kw_only=True):
    type: str


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless "medium" (the default)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's Responses request fields, then vLLM's sampling extensions, then kvwire's (module docstring)."""

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    stream: bool = False
    store: bool | None = None  # only false: nothing is stored
    previous_response_id: str | None = None  # refused: nothing is stored
    background: bool | None = None  # only false
    tools: list[dict[str, Any]] | None = None  # refused unless empty
    tool_choice: str | None = None  # only "none" or "auto" (with no tools)
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: TextConfig | None = None  # format "text" only
    reasoning: dict[str, Any] | None = None  # refused
    include: list[str] | None = None  # refused unless empty (no logprobs, no reasoning content)
    top_logprobs: int | None = None  # refused unless 0
    truncation: str | None = None  # only "disabled"
    metadata: dict[str, str] | None = None  # echoed in the answer
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix caches key by tokens: accepted, not needed
    service_tier: str | None = None  # only "auto" or "default"
    # vLLM's extensions
    seed: int | None = None
    stop: Stop = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    # kvwire's
    disaggregate: bool = True


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


def as_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request `req` stands for (module docstring, step 2). Raises APIError(400)."""
    _require(not req.store, "store", "answers are not stored (store must be false or left out)")
    _require(req.previous_response_id is None, "previous_response_id",
             "answers are not stored: send the earlier turns in input")
    _require(not req.background, "background", "background responses are not supported")
    _require(not req.tools, "tools", "tools are not supported")
    _require(req.tool_choice in (None, "none", "auto"), "tool_choice", "tool_choice needs tools, which are not "
                                                                       "supported")
    _require(req.reasoning is None, "reasoning", "reasoning is not supported")
    _require(not req.include, "include", "include is not supported (no logprobs, no reasoning content)")
    _require(not req.top_logprobs, "top_logprobs", "logprobs are not supported by the Responses API here")
    _require(req.truncation in (None, "disabled"), "truncation", "only truncation \"disabled\" is supported")
    _require(req.service_tier in (None, "auto", "default"), "service_tier", "only service_tier \"auto\"")
    text = req.text
    _require(text is None or text.format is None or text.format.type == "text", "text.format",
             "only text.format {\"type\": \"text\"} is supported")
    _require(text is None or text.verbosity in (None, "medium"), "text.verbosity", "only verbosity \"medium\"")
    _require(req.max_output_tokens is None or req.max_output_tokens >= 1, "max_output_tokens",
             "max_output_tokens must be at least 1")
    lead = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    turns = [ChatMessage(role="user", content=req.input)] if isinstance(req.input, str) else \
        [_message(m, i) for i, m in enumerate(req.input)]
    _require(bool(turns), "input", "input must not be empty")
    return ChatRequest(model=req.model, messages=lead + turns, max_completion_tokens=req.max_output_tokens,
                       temperature=req.temperature, top_p=req.top_p, stream=req.stream, seed=req.seed, stop=req.stop,
                       top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                       ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, user=req.user,
                       disaggregate=req.disaggregate)


# what a chat request's refusal names, as the Responses request named it
_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


def renamed(exc: APIError) -> APIError:
    """A refusal of the chat request `as_chat` made, naming the Responses request's field."""
    if exc.param not in _PARAMS:
        return exc
    name = _PARAMS[exc.param]
    return APIError(exc.status, exc.message.replace(exc.param, name), type_=exc.type, param=name, code=exc.code)


def _message(m: InputMessage, i: int) -> ChatMessage:
    param = f"input[{i}]"
    _require(m.type == "message", param, f"input items of type {m.type!r} are not supported (messages only)")
    _require(m.role in _ROLES, f"{param}.role", f"role {m.role!r} is not one of {', '.join(_ROLES)}")
    if isinstance(m.content, str):
        return ChatMessage(role=_ROLES[m.role], content=m.content)
    for part in m.content:
        _require(part.type in _TEXT_PARTS and part.text is not None, f"{param}.content",
                 f"content parts of type {part.type!r} are not supported (input_text and output_text only)")
    return ChatMessage(role=_ROLES[m.role], content=[ContentPart(type="text", text=p.text) for p in m.content])


class ResponseShaper:
    """One request's Response body, whole or as the Responses API's stream of events."""

    def __init__(self, req: ResponsesRequest, model: str, prompt_tokens: int = 0):
        self.req = req
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._sequence = 0
        self._text = ""

    def whole(self, choice: Choice, usage: dict, kvwire: dict) -> dict:
        """The non-streamed answer."""
        return self._response(choice, choice.text, usage) | {"kvwire": kvwire}

    def opening(self) -> list[dict]:
        """A stream's first events, before any text."""
        head = self._response(None, "", None)
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head),
                self._event("response.output_item.added", output_index=0, item=self._item("", "in_progress")),
                self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                            part=_part(""))]

    def delta(self, text: str) -> dict | None:
        """The event of `text` added to the answer; None for none."""
        if not text:
            return None
        self._text += text
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def closing(self, choice: Choice, usage: dict, kvwire: dict) -> list[dict]:
        """A stream's last events: the text, part and item done, then completed (its status maybe incomplete)."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        response = self._response(choice, self._text, usage) | {"kvwire": kvwire}
        return [self._event("response.output_text.done", **where, text=self._text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_part(self._text)),
                self._event("response.output_item.done", output_index=0, item=self._item(self._text, "completed")),
                self._event("response.completed", response=response)]  # status "incomplete" too, as vLLM
        # sends it: the openai client's stream helper ends on response.completed alone

    def error(self, exc: APIError) -> dict:
        """The event of an error that ended a stream."""
        return self._event("error", code=str(exc.code), message=exc.message, param=exc.param)

    @staticmethod
    def error_body(exc: APIError) -> dict:
        return exc.body()  # OpenAI's

    def _event(self, kind: str, **fields: Any) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _item(self, text: str, status: str) -> dict:
        content = [_part(text)] if status == "completed" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _response(self, choice: Choice | None, text: str, usage: dict | None) -> dict:
        """The Response object: in progress (no choice yet), completed, or incomplete (max_output_tokens)."""
        req = self.req
        incomplete = choice is not None and choice.finish_reason == "length"
        status = "in_progress" if choice is None else "incomplete" if incomplete else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": [] if choice is None else [self._item(text, "completed")],
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": req.tool_choice or "auto",
            "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "previous_response_id": None, "reasoning": None, "metadata": req.metadata or {}, "user": req.user,
            "usage": None if usage is None else _usage(usage),
        }


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(chat: dict) -> dict:
    """The Responses API's usage from the chat answer's."""
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"],
            "input_tokens_details": {**chat["prompt_tokens_details"], "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


RESPONSES = ChatAdapter(ResponsesRequest, as_chat, renamed, ResponseShaper)
