"""A decode instance's answer, given to the client: whole, or relayed chunk by chunk as its stream comes (an SSE
error event if the stream breaks). What the router learns from it, on the way: the request's path and status
counts, the instance's health (a 5xx is a failure of it), where the prompt and its answer are now held
(`Scheduler.answered`, router/vllm/schedule.py), a stored Response's home (router/vllm/stored.py), and whether the
instance held what the router predicted (router/vllm/usage.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import anyio
import httpx2
from fastapi.responses import Response, StreamingResponse

from kvwire.engine.block_names import ROOT
from kvwire.observability.metrics import Metrics
from kvwire.router.vllm import http as http
from kvwire.router.vllm import upstream as upstream
from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.pool import InstancePool
from kvwire.router.vllm.prefill import Prefilled, record_failure
from kvwire.router.vllm.schedule import Scheduler
from kvwire.router.vllm.stored import StoredResponses
from kvwire.router.vllm.tokens import completion_tokens_of
from kvwire.router.vllm.upstream import FailureKind, InstanceError
from kvwire.router.vllm.usage import cached_tokens_in, check_held

log = logging.getLogger(__name__)


class Call(NamedTuple):
    """One client request as the router passes it on."""

    rid: str
    endpoint: Endpoint
    body: dict[str, Any]
    headers: dict[str, str]
    started: float  # its arrival (time.monotonic())
    deadline: float  # the last moment it may wait for a decode instance to take it
    tokens: list[int] | None = None  # its prompt's token ids, when the scheduler read them
    scope: bytes = ROOT  # its prompt's cache scope (router/vllm/cache_scope.py)


class Answers:
    """The decode instances' answers to the router's calls (module docstring)."""

    def __init__(self, metrics: Metrics, decode: InstancePool, schedule: Scheduler, stored: StoredResponses):
        self.metrics = metrics
        self.decode = decode
        self.schedule = schedule
        self.stored = stored

    def whole(self, resp: httpx2.Response, call: Call, url: str, prefilled: Prefilled, held: int) -> Response:
        """The client's answer from decode instance `url`'s whole one (or a stream's that was not 200), predicted to
        hold `held` of its prompt tokens (0: not checked)."""
        self._answered(resp, call.rid, url, prefilled)
        self.count(resp.status_code)
        if resp.status_code == 200:
            if held:
                check_held(self.metrics, call.rid, url, held, cached_tokens_in(resp.content, stream=False))
            self.schedule.answered(url, call.tokens, completion_tokens_of(resp.content), call.scope)
            self.stored.remember_from(call.endpoint, url, resp.content)
        return http.whole(resp, call.rid, prefilled.headers(url))

    async def stream(self, resp: httpx2.Response, call: Call, url: str, prefilled: Prefilled, blocks: int,
                     held: int) -> Response:
        """The client's stream, from decode instance `url`'s first chunk (read here: a stream cut before it is an
        InstanceError of the call); `url` counts the request until the relay ends."""
        chunks = upstream.stream_bytes(resp, call.rid, url)
        try:
            first = await anext(chunks, b"")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            raise
        self.metrics.ttft_seconds.observe(time.monotonic() - call.started)
        self._answered(resp, call.rid, url, prefilled)
        return StreamingResponse(self._relay(resp, chunks, first, call, url, blocks, held),
                                 media_type=resp.headers.get("content-type"),
                                 headers={"x-request-id": call.rid} | prefilled.headers(url))

    def _answered(self, resp: httpx2.Response, rid: str, url: str, prefilled: Prefilled) -> None:
        self.metrics.vllm_requests.labels(str(prefilled.path)).inc()
        self.metrics.vllm_path_reasons.labels(str(prefilled.path), str(prefilled.reason)).inc()
        if upstream.is_instance_fault(resp.status_code):
            record_failure(self.metrics, self.decode, url,
                           InstanceError(rid, url, FailureKind.BROKEN, f"answered {resp.status_code}"))
        else:
            self.decode.observe(url, None)

    async def _relay(self, resp: httpx2.Response, chunks: AsyncIterator[bytes], first: bytes, call: Call, peer: str,
                     blocks: int, held: int):
        """The decode instance's stream, chunk by chunk from `first`; an SSE error event if it breaks."""
        status, events = 200, first.count(b"data: {")  # an event a generated token, near enough for the index
        cached = cached_tokens_in(first, stream=True) if held else None
        try:
            stored = self.stored.remember_from(call.endpoint, peer, first)
            yield first
            async for chunk in chunks:
                events += chunk.count(b"data: {")
                stored = stored or self.stored.remember_from(call.endpoint, peer, chunk)
                if held and (said := cached_tokens_in(chunk, stream=True)) is not None:
                    cached = said
                yield chunk
            self.schedule.answered(peer, call.tokens, events, call.scope)
            if held:
                check_held(self.metrics, call.rid, peer, held, cached)
        except InstanceError as exc:
            log.warning("%s; stream cut", exc)
            record_failure(self.metrics, self.decode, peer, exc)
            err = http.failed(exc)
            status = err.status
            yield f"\n\ndata: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            self.decode.ended(peer, blocks)
            with anyio.CancelScope(shield=True):  # the client may have gone: close the instance's stream anyway
                await resp.aclose()
        self.count(status)

    def count(self, http_status: int) -> None:
        self.metrics.requests.labels(str(http.request_status(http_status))).inc()
