"""The router in front of vLLM servers: POST /v1/completions and /v1/chat/completions,
GET /v1/models, /healthz, /readyz and /metrics.

Lifecycle of a request:

1. ARRIVED: its body is read as JSON (400 if it is not an object) and it gets a request id
   (the client's X-Request-Id, or a new one), sent to both instances and back to the client.
   With no decode instance up it is answered 503 at once.
2. PREFILL: the next prefill instance up gets the body with max_tokens=1, stream=false and
   kv_transfer_params={"do_remote_decode": true}. Its 4xx goes back to the client unchanged.
   With no prefill instance up, or one that fails or answers 5xx (taken out of rotation), or
   an answer without kv_transfer_params (a vLLM with no KV connector), the request goes on
   decode-only.
3. DECODE: the next decode instance up gets the client's body with the prefill's
   kv_transfer_params. One that cannot be reached is taken out and the next one tried; one
   that times out or breaks is taken out and the client gets a 504 or 502.
4. ANSWERED: the decode instance's answer, whole or as its SSE stream chunk by chunk, goes
   back with an x-kvwire-path header (disaggregated or decode-only).

Each answer counts in kvwire_requests_total{status} (a stream when it ends) and each one a
decode instance gave in kvwire_vllm_requests_total{path}; a stream's first chunk's time since
arrival goes to kvwire_ttft_seconds (a whole answer's time is not its time to first token).
Instances leave rotation and come back as router/vllm_pool.py tells.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, NamedTuple

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvwire.connectors.config import NodeRole
from kvwire.observability.labels import InstanceState, ProxyPath, RequestStatus
from kvwire.observability.metrics import CONTENT_TYPE, Metrics, process_metrics
from kvwire.router import vllm_upstream as upstream
from kvwire.router.config import VLLMRouterConfig
from kvwire.router.schemas import APIError
from kvwire.router.vllm_bodies import Endpoint, decode_body, is_stream, kv_transfer_params_of, parse_body, prefill_body
from kvwire.router.vllm_pool import HealthProbe, InstancePool, run_health_checks
from kvwire.router.vllm_upstream import FailureKind, InstanceError

log = logging.getLogger(__name__)
PATH_HEADER = "x-kvwire-path"
_PROBE_READ_TIMEOUT_S = 5.0  # vLLM answers /health at once; a busy event loop may not


class Prefilled(NamedTuple):
    """What the prefill step left: the kv_transfer_params for the decode instance (None:
    decode-only), or a prefill instance's 4xx to give the client instead."""

    kv_transfer_params: dict[str, Any] | None
    refusal: httpx.Response | None = None


class VLLMRouter:
    """The route handlers, over one connection pool and the two instance pools."""

    def __init__(self, config: VLLMRouterConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.prefill = InstancePool(NodeRole.PREFILL, config.prefill_urls)
        self.decode = InstancePool(NodeRole.DECODE, config.decode_urls)
        self._client: httpx.AsyncClient | None = None
        self._without_params: set[str] = set()  # prefill instances that answered no kv_transfer_params
        for pool in (self.prefill, self.decode):
            metrics.watch_instances(str(pool.role), pool.count)

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None  # the lifespan opens it before serving
        return self._client

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        connect = self.config.connect_timeout_s
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=connect)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)  # streams hold theirs
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            self._client = client
            probe = HealthProbe(client, httpx.Timeout(max(_PROBE_READ_TIMEOUT_S, connect), connect=connect))
            pools = (self.prefill, self.decode)
            await asyncio.gather(*(pool.check(probe) for pool in pools))  # serve knowing who is up
            checks = asyncio.create_task(run_health_checks(pools, probe, self.config.health_interval_s))
            try:
                yield
            finally:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks

    async def healthz(self):
        """200 "ok" with prefill and decode instances up, 200 "decode-only" with decode ones alone, else 503."""
        decode_up, prefill_up = self.decode.count(InstanceState.UP), self.prefill.count(InstanceState.UP)
        status = "ok" if decode_up and prefill_up else str(ProxyPath.DECODE_ONLY) if decode_up else "unavailable"
        return JSONResponse({"status": status, "prefill": self.prefill.describe(), "decode": self.decode.describe()},
                            status_code=200 if decode_up else 503)

    async def readyz(self):
        """200 while a decode instance is up; 503 otherwise."""
        up = self.decode.count(InstanceState.UP)
        return JSONResponse({"ready": bool(up), "decode_instances": up}, status_code=200 if up else 503)

    async def metrics_text(self):
        return Response(content=self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(self, request: Request):
        """A decode instance's GET /v1/models, as it answers."""
        rid = _request_id(request)
        for _ in self.config.decode_urls:
            url = self.decode.pick()
            if url is None:
                break
            try:
                resp = await upstream.get(self.client, rid, url, "/v1/models", _upstream_headers(request, rid))
            except InstanceError as exc:
                self.decode.take_out(url, exc.reason)
                continue
            return _whole(resp, rid, None)
        raise _no_decode(rid)

    async def completions(self, request: Request):
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: Request):
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.monotonic()
        rid = _request_id(request)
        try:
            body = parse_body(await request.body())
            if not self.decode.count(InstanceState.UP):
                raise _no_decode(rid)
            headers = _upstream_headers(request, rid)
            prefilled = await self._prefill(rid, endpoint, body, headers)
            if prefilled.refusal is not None:
                self._count(prefilled.refusal.status_code)
                return _whole(prefilled.refusal, rid, None)
            path = ProxyPath.DECODE_ONLY if prefilled.kv_transfer_params is None else ProxyPath.DISAGGREGATED
            return await self._decode(rid, endpoint, decode_body(body, prefilled.kv_transfer_params), headers, path,
                                      started)
        except APIError as exc:
            self._count(exc.status)
            return JSONResponse(exc.body(), status_code=exc.status, headers={"x-request-id": rid})
        except Exception:
            self._count(500)
            raise

    async def _prefill(self, rid: str, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str]) -> Prefilled:
        url = self.prefill.pick()
        if url is None:
            return Prefilled(None)
        try:
            resp = await upstream.post(self.client, rid, url, endpoint, prefill_body(body, endpoint), headers)
        except InstanceError as exc:
            self.prefill.take_out(url, exc.reason)
            log.warning("%s; request %s goes on decode-only", exc, rid)
            return Prefilled(None)
        if upstream.is_instance_fault(resp.status_code):
            self.prefill.take_out(url, f"answered {resp.status_code}")
            log.warning("request %s: prefill instance %s answered %d; decode-only", rid, url, resp.status_code)
            return Prefilled(None)
        if resp.status_code != 200:
            return Prefilled(None, refusal=resp)
        params = kv_transfer_params_of(resp.content)
        if params is None:
            # a vLLM with no KV connector answers null every time: say so once per instance
            level = logging.DEBUG if url in self._without_params else logging.WARNING
            self._without_params.add(url)
            log.log(level, "request %s: prefill instance %s answered no kv_transfer_params (started without "
                    "--kv-transfer-config?); decode-only", rid, url)
        return Prefilled(params)

    async def _decode(self, rid: str, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str],
                      path: ProxyPath, started: float) -> Response:
        stream = is_stream(body)
        call = upstream.open_stream if stream else upstream.post
        for _ in self.config.decode_urls:
            url = self.decode.pick()
            if url is None:
                break
            try:
                resp = await call(self.client, rid, url, endpoint, body, headers)
            except InstanceError as exc:
                self.decode.take_out(url, exc.reason)
                if exc.kind == FailureKind.UNREACHABLE:
                    log.warning("%s; trying the next decode instance", exc)
                    continue
                raise _failed(exc) from None
            self.metrics.vllm_requests.labels(str(path)).inc()
            if upstream.is_instance_fault(resp.status_code):
                self.decode.take_out(url, f"answered {resp.status_code}")
            if not stream or resp.status_code != 200:  # open_stream read and closed an answer other than 200
                self._count(resp.status_code)
                return _whole(resp, rid, path)
            return StreamingResponse(self._relay(resp, rid, url, started), media_type=resp.headers.get("content-type"),
                                     headers={"x-request-id": rid, PATH_HEADER: str(path)})
        raise _no_decode(rid)

    async def _relay(self, resp: httpx.Response, rid: str, peer: str, started: float):
        """The decode instance's stream, chunk by chunk; an SSE error event if it breaks."""
        status, first = 200, True
        try:
            async for chunk in upstream.stream_bytes(resp, rid, peer):
                if first:
                    self.metrics.ttft_seconds.observe(time.monotonic() - started)
                    first = False
                yield chunk
        except InstanceError as exc:
            log.warning("%s; stream cut", exc)
            self.decode.take_out(peer, exc.reason)
            err = _failed(exc)
            status = err.status
            yield f"\n\ndata: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            with anyio.CancelScope(shield=True):  # the client may have gone: close the instance's stream anyway
                await resp.aclose()
        self._count(status)

    def _count(self, http_status: int) -> None:
        self.metrics.requests.labels(str(_request_status(http_status))).inc()


def create_vllm_app(config: VLLMRouterConfig, metrics: Metrics | None = None) -> FastAPI:
    """The router's app in front of vLLM; its metrics go to `metrics`, this process's by default."""
    router = VLLMRouter(config, metrics or process_metrics())
    app = FastAPI(title="kvwire router (vLLM)", lifespan=router.lifespan)
    app.add_api_route("/healthz", router.healthz, methods=["GET"])
    app.add_api_route("/readyz", router.readyz, methods=["GET"])
    app.add_api_route("/metrics", router.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route(str(Endpoint.COMPLETIONS), router.completions, methods=["POST"])
    app.add_api_route(str(Endpoint.CHAT), router.chat_completions, methods=["POST"])
    app.add_exception_handler(APIError, _api_error)
    return app


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)  # the handler of APIError only
    return JSONResponse(exc.body(), status_code=exc.status)


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or f"kvw-{uuid.uuid4().hex}"


def _upstream_headers(request: Request, rid: str) -> dict[str, str]:
    headers = {"x-request-id": rid}
    if auth := request.headers.get("authorization"):
        headers["authorization"] = auth
    return headers


def _whole(resp: httpx.Response, rid: str, path: ProxyPath | None) -> Response:
    """An instance's whole answer, as it gave it."""
    headers = {"x-request-id": rid} | ({PATH_HEADER: str(path)} if path else {})
    return Response(resp.content, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))


def _no_decode(rid: str) -> APIError:
    return APIError(503, f"request {rid}: no vLLM decode instance is up", type_="service_unavailable")


def _failed(exc: InstanceError) -> APIError:
    if exc.kind == FailureKind.TIMEOUT:
        return APIError(504, str(exc), type_="timeout")
    return APIError(502, str(exc), type_="bad_gateway")


def _request_status(http_status: int) -> RequestStatus:
    if http_status < 400:
        return RequestStatus.OK
    if http_status < 500:
        return RequestStatus.INVALID
    return {503: RequestStatus.UNAVAILABLE, 504: RequestStatus.TIMEOUT}.get(http_status, RequestStatus.ERROR)
