"""One HTTP call from the router to a vLLM instance, and how it can fail."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from kvwire.router.vllm.bodies import Endpoint


class FailureKind(enum.StrEnum):
    """How a call to an instance failed (an HTTP answer, even a 5xx, is not a failure here)."""

    REFUSED = "refused"  # no connection, refused: nobody serves there (the request never reached it)
    BUSY = "busy"  # no connection within the connect timeout: a loaded host (the request never reached it)
    TIMEOUT = "timeout"  # connected, but no answer within the request timeout
    BROKEN = "broken"  # the connection broke or the answer was not HTTP


class InstanceError(Exception):
    """A call to one vLLM instance failed.

    Attributes:
        request_id: the router's id of the request (its X-Request-Id).
        peer: the instance's base URL.
        kind: how it failed.
        reason: the transport's words.
    """

    def __init__(self, request_id: str, peer: str, kind: FailureKind, reason: str):
        super().__init__(f"request {request_id}: vLLM instance {peer} {kind}: {reason}")
        self.request_id = request_id
        self.peer = peer
        self.kind = kind
        self.reason = reason


def is_instance_fault(status: int) -> bool:
    """Whether an HTTP status says the instance, not the request, is at fault (5xx)."""
    return status >= 500


# What a call to an instance may raise when the instance fails, beside httpx2's own errors: httpcore2 over anyio
# raises AttributeError ('NoneType' object has no attribute 'getpeername') when the peer dies while the
# connection is being set up (its socket is closed under it), and an OSError can escape the same way.
PEER_ERRORS = (httpx2.HTTPError, OSError, AttributeError)


def failure_kind(exc: Exception) -> FailureKind:
    """How a call that raised `exc` (one of PEER_ERRORS) failed."""
    if isinstance(exc, httpx2.ConnectError):
        return FailureKind.REFUSED
    if isinstance(exc, httpx2.ConnectTimeout):
        return FailureKind.BUSY
    if isinstance(exc, httpx2.TimeoutException):
        return FailureKind.TIMEOUT
    return FailureKind.BROKEN


def unsent(kind: FailureKind) -> bool:
    """Whether a call that failed so never reached the instance (another may take the request)."""
    return kind in (FailureKind.REFUSED, FailureKind.BUSY)


def _failure(exc: Exception, request_id: str, peer: str) -> InstanceError:
    return InstanceError(request_id, peer, failure_kind(exc), str(exc) or type(exc).__name__)


async def post(client: httpx2.AsyncClient, request_id: str, peer: str, endpoint: Endpoint, body: dict[str, Any],
               headers: dict[str, str]) -> httpx2.Response:
    """POST `body` to `peer` and read the whole answer.

    Args:
        client: the router's connection pool.
        request_id, peer: for the error.
        endpoint: which path of `peer`.
        body: the JSON body; headers: sent with it.
    Returns:
        the answer, whatever its status.
    Raises:
        InstanceError: no connection, no answer in time, or a broken one.
    """
    try:
        return await client.post(f"{peer}{endpoint}", json=body, headers=headers)
    except PEER_ERRORS as exc:
        raise _failure(exc, request_id, peer) from exc


async def open_stream(client: httpx2.AsyncClient, request_id: str, peer: str, endpoint: Endpoint,
                      body: dict[str, Any], headers: dict[str, str]) -> httpx2.Response:
    """POST `body` to `peer` and read the answer's head; the caller reads the body and must
    close the answer (`aclose`). An answer other than 200 comes back read and closed.

    Args and Raises: as `post`.
    """
    req = client.build_request("POST", f"{peer}{endpoint}", json=body, headers=headers)
    try:
        resp = await client.send(req, stream=True)
    except PEER_ERRORS as exc:
        raise _failure(exc, request_id, peer) from exc
    if resp.status_code != 200:
        try:
            await resp.aread()
        except PEER_ERRORS as exc:
            raise _failure(exc, request_id, peer) from exc
        finally:
            await resp.aclose()
    return resp


async def open_call(client: httpx2.AsyncClient, request_id: str, peer: str, method: str, path: str, content: bytes,
                    headers: dict[str, str]) -> httpx2.Response:
    """`method` `path` of `peer` with `content` as the body, as the client sent it; the answer's head read (the caller
    reads its body, `stream_bytes`, and closes it). Returns: the answer, whatever its status. Raises: InstanceError."""
    req = client.build_request(method, f"{peer}{path}", content=content or None, headers=headers)
    try:
        return await client.send(req, stream=True)
    except PEER_ERRORS as exc:
        raise _failure(exc, request_id, peer) from exc


async def call_whole(client: httpx2.AsyncClient, request_id: str, peer: str, method: str, path: str,
                     content: bytes, headers: dict[str, str]) -> httpx2.Response:
    """As `open_call`, the whole answer read. Raises: InstanceError."""
    try:
        return await client.request(method, f"{peer}{path}", content=content or None, headers=headers)
    except PEER_ERRORS as exc:
        raise _failure(exc, request_id, peer) from exc


async def stream_bytes(resp: httpx2.Response, request_id: str, peer: str) -> AsyncIterator[bytes]:
    """The bytes of an answer opened by `open_stream`, as they arrive. Raises: InstanceError."""
    try:
        async for chunk in resp.aiter_bytes():
            yield chunk
    except PEER_ERRORS as exc:
        raise _failure(exc, request_id, peer) from exc
