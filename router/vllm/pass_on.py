"""Calls the router passes on to one decode instance as the client made them, and relays as the instance answers
(whole or streamed, whatever its status):

- GET /v1/models and /version, POST /tokenize, /detokenize and /v1/messages/count_tokens: the least loaded
  decode instance up (each serves the one model), or the next one up when a call does not reach it;
- GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: the decode instance that holds the stored answer
  (router/vllm/stored.py); for an id the router does not know, each instance up in turn until one does not
  answer 404.

No prefill instance takes part, so these answers carry no x-kvwire-path; x-kvwire-decode names the instance.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import anyio
import httpx2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvwire.observability.labels import InstanceState
from kvwire.observability.metrics import Metrics
from kvwire.router.vllm import http as http
from kvwire.router.vllm import upstream as upstream
from kvwire.router.vllm.pool import InstancePool
from kvwire.router.vllm.prefill import DECODE_HEADER, record_failure
from kvwire.router.vllm.stored import StoredResponses
from kvwire.router.vllm.upstream import InstanceError

log = logging.getLogger(__name__)
PASSED_ON_PATHS = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")
_BODY_HEADERS = ("content-type",)


class PassOn:
    """The pass-through routes (module docstring) over the decode instances."""

    def __init__(self, client: Callable[[], httpx2.AsyncClient], decode: InstancePool, metrics: Metrics,
                 stored: StoredResponses):
        self._client = client
        self.decode = decode
        self._metrics = metrics
        self.stored = stored

    async def to_any(self, request: Request) -> Response:
        """The call, to the least loaded decode instance up."""
        first = self.decode.pick()
        up = self.decode.urls(InstanceState.UP)
        return await self._relay_first(request, [first, *(u for u in up if u != first)] if first else [], False)

    async def to_holder(self, request: Request, response_id: str) -> Response:
        """The call about stored answer `response_id`, to the decode instance that holds it."""
        up = self.decode.urls(InstanceState.UP)
        home = self.stored.home(response_id)
        if home in up:
            return await self._relay_first(request, [home], False)
        return await self._relay_first(request, up, True)

    async def _relay_first(self, request: Request, urls: list[str], past_404: bool) -> Response:
        """The answer of the first of `urls` that the call reaches (that answers other than 404, `past_404`)."""
        rid = http.request_id(request)
        content = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = http.upstream_headers(request, rid) | {
            name: value for name in _BODY_HEADERS if (value := request.headers.get(name))}
        last: InstanceError | None = None
        for i, url in enumerate(urls):
            try:
                resp = await upstream.open_call(self._client(), rid, url, request.method, path, content, headers)
            except InstanceError as exc:
                record_failure(self._metrics, self.decode, url, exc)
                last = exc
                continue
            self.decode.observe(url, None)
            if past_404 and resp.status_code == 404 and i + 1 < len(urls):
                await resp.aclose()
                continue
            return StreamingResponse(_bytes(resp, rid, url), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"),
                                     headers={"x-request-id": rid, DECODE_HEADER: url})
        raise http.no_decode(rid) if last is None else http.failed(last)


async def _bytes(resp: httpx2.Response, rid: str, url: str) -> AsyncIterator[bytes]:
    """The instance's answer as it comes; cut short (the client sees a broken answer) if the instance breaks."""
    try:
        async for chunk in upstream.stream_bytes(resp, rid, url):
            yield chunk
    except InstanceError as exc:
        log.warning("%s; its answer was cut", exc)
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
