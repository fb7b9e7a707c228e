"""What an API the router serves as a chat request provides (OpenAI's Responses API: router/responses_api.py;
Anthropic's Messages API: router/messages_api.py): its request type, the chat request it stands for, a refusal
renamed as its fields, and the shaper of its answers (router/app.py runs them alike)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from kvwire.router.choice import Choice
from kvwire.router.schemas import APIError, ChatRequest


class EventShaper(Protocol):
    """One request's answer: whole, or a stream of named events."""

    id: str

    def whole(self, choice: Choice, usage: dict, kvwire: dict) -> dict: ...

    def opening(self) -> list[dict]: ...

    def delta(self, text: str) -> dict | None: ...

    def closing(self, choice: Choice, usage: dict, kvwire: dict) -> list[dict]: ...

    def error(self, exc: APIError) -> dict: ...  # the event of an error that ends a stream

    def error_body(self, exc: APIError) -> dict: ...  # the body of a refused request


class ChatAdapter(NamedTuple):
    request: type  # a msgspec Struct, parsed with schemas.parse_body
    as_chat: Callable[[Any], ChatRequest]  # Raises APIError(400)
    renamed: Callable[[APIError], APIError]  # a chat refusal, naming this API's field
    shaper: Callable[[Any, str, int], EventShaper]  # (request, served model name, prompt tokens)


def named_sse(event: dict) -> str:
    """An event of a stream, named by its type (both APIs name every event)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
