"""The HTTP pieces of the router in front of vLLM: request ids, the headers passed on, an instance's whole
answer as the client gets it, and the router's own error answers."""

from __future__ import annotations

import uuid

import httpx2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvwire.observability.labels import RequestStatus
from kvwire.router.schemas import APIError
from kvwire.router.vllm.upstream import FailureKind, InstanceError


async def api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)  # the handler of APIError only
    return JSONResponse(exc.body(), status_code=exc.status)


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or f"kvw-{uuid.uuid4().hex}"


# Passed on to every vLLM instance a request reaches, as the client sent them: its credentials, and its W3C
# trace context, so that vLLM's own OpenTelemetry spans join the client's trace.
PASSED_ON = ("authorization", "traceparent", "tracestate")
DP_RANK = "x-data-parallel-rank"  # vLLM's: the data-parallel engine that takes the request (router/vllm/pool.py)


def upstream_headers(request: Request, rid: str) -> dict[str, str]:
    return {"x-request-id": rid} | {name: value for name in PASSED_ON if (value := request.headers.get(name))}


def trace_id(request: Request) -> str:
    """The trace id of the client's W3C `traceparent` (version-traceid-parentid-flags), or "" without one."""
    parts = request.headers.get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def whole(resp: httpx2.Response, rid: str, kvwire_headers: dict[str, str]) -> Response:
    """An instance's whole answer, as it gave it, with the request id and `kvwire_headers`."""
    headers = {"x-request-id": rid} | kvwire_headers
    return Response(resp.content, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))


def no_decode(rid: str) -> APIError:
    return APIError(503, f"request {rid}: no vLLM decode instance is up", type_="service_unavailable")


def failed(exc: InstanceError) -> APIError:
    if exc.kind == FailureKind.TIMEOUT:
        return APIError(504, str(exc), type_="timeout")
    return APIError(502, str(exc), type_="bad_gateway")


def request_status(http_status: int) -> RequestStatus:
    if http_status < 400:
        return RequestStatus.OK
    if http_status < 500:
        return RequestStatus.INVALID
    return {503: RequestStatus.UNAVAILABLE, 504: RequestStatus.TIMEOUT}.get(http_status, RequestStatus.ERROR)
