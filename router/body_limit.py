"""A cap on request bodies, for both routers: a body over it is refused before it is read.

An ASGI middleware in front of either app (router/app.py, router/vllm/proxy.py):

1. A request whose `content-length` says more than the cap gets a 413 at once, naming the cap; not a
   byte of its body is read (the server then drops what the client still sends with the connection).
2. A body of unstated length (chunked) is read as it comes, up to the cap: one byte more and the
   request gets the same 413, nothing more is read.
3. Otherwise the body, read whole (the apps read it whole anyway), is handed to the app as one
   message, and the app's later `receive()` calls (the vLLM router waits on one for the client's
   disconnect) go to the connection as before.

Requests without a body (GET) pass through untouched.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 16 << 20  # default cap: a 128k-token prompt as token ids in JSON is about 1 MiB; 16 is generous
_OVER = b"\0over"  # _read's mark for a body past the cap (compared by identity)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        """Raises ValueError for a cap below 1."""
        if max_bytes < 1:
            raise ValueError(f"the request body cap must be at least 1 byte, not {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        stated = _content_length(scope)
        if stated is not None and stated > self.max_bytes:
            await self._refuse(send, f"{stated} bytes")
            return
        body = await self._read(receive)
        if body is _OVER:
            await self._refuse(send, "more bytes")
        elif body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body up to the cap; _OVER when it goes on past it (the rest is left unread); None when the client
        left before sending it all (nobody to answer)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return _OVER
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, send: Send, what: str) -> None:
        message = (f"request body of {what} exceeds this router's limit of {self.max_bytes} bytes "
                   "(kvwire router --max-body-bytes)")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers", ()))
    return b"content-length" in headers or b"transfer-encoding" in headers


def _content_length(scope: Scope) -> int | None:
    """The stated length; None when none is stated, or what is stated is not a length (read as it comes)."""
    value = dict(scope.get("headers", ())).get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body read once, then defers to the connection's."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
