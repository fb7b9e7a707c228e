"""The router in front of vLLM servers: POST /v1/completions, /v1/chat/completions, /v1/responses (OpenAI's
Responses API) and /v1/messages (Anthropic's Messages API), each disaggregated as below; GET /v1/models, /healthz,
/readyz and /metrics; and the calls it passes on to a decode instance as they are (router/vllm/pass_on.py).

Lifecycle of a request:

1. ARRIVED: its body is read as JSON (400 if it is not an object) and it gets a request id
   (the client's X-Request-Id, or a new one), sent to both instances and back to the client.
   With no decode instance up it waits for one, up to `instance_wait_s`, then gets a 503.
2. PLACED (router/vllm/schedule.py): its prompt's token ids (from an instance's POST /tokenize, when the
   scheduler needs them) pick its decode instance, by the prefix each holds and its load, and its path:
   decode-only when that instance holds all but a short part of the prompt, or when the body is a batch of
   several prompts, asks for beam search or prompt logprobs, or continues a stored Responses answer
   (bodies.decode_only_reason; the last goes to the decode instance that holds it, router/vllm/stored.py).
3. PREFILL (router/vllm/prefill.py): the prefill instance the scheduler picks computes the prompt
   (max_tokens 1, its KV kept for a decode instance). Its 4xx goes back to the client unchanged.
   With no prefill instance up, every one up with `prefill_max_in_flight` requests in flight, or one
   that fails or answers 5xx, or an answer without kv_transfer_params (a vLLM with no KV connector),
   the request goes on decode-only.
   - ALONGSIDE (the default once a prefill instance's answers showed KvwireConnector; not with
     `sequential`): the router names the KV's directory key itself and sends the decode step at
     once, its params saying where to wait for the KV; if the prefill step fails before the
     decode instance answers, that call is cancelled (vLLM aborts the request) and the request
     goes on decode-only.
   - SEQUENTIAL: the decode step starts once the prefill instance has answered, with its params.
4. DECODE: the decode instance placed gets the client's body with those params (a request of n > 1 choices
   to a data-parallel instance, with `x-data-parallel-rank` naming its least busy engine: vLLM would spread
   the choices over its engines, each pulling the one KV). A call
   that never reached its instance (refused, or no connection in time) is tried again, on another
   instance if one is up, with back-off until `instance_wait_s` after arrival; one that reached it
   and timed out or broke gives the client a 504 or 502.
5. ANSWERED (router/vllm/answers.py): the decode instance's answer, whole or as its SSE stream chunk by
   chunk (from its first chunk), with x-kvwire-path (disaggregated or decode-only), x-kvwire-reason (why: PathReason),
   x-kvwire-decode and, when one computed the prompt, x-kvwire-prefill (the instances' base URLs).

A client that goes away before its answer starts cancels the request's calls to the instances (vLLM aborts
a request whose caller left), counted as kvwire_requests_total{status="cancelled"}; a stream's relay ends
with its client (Starlette).

Each answer counts in kvwire_requests_total{status} (a stream when it ends) and each one a
decode instance gave in kvwire_vllm_requests_total{path} and kvwire_vllm_path_reasons_total{path,
reason}; each failed call in kvwire_vllm_instance_failures_total{role,kind}. A stream's first chunk's
time since arrival goes to kvwire_ttft_seconds (a whole answer's time is not its time to first token).
Instances are weighed, leave rotation and come back as router/vllm/pool.py tells.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvwire.connectors.config import NodeRole
from kvwire.engine.block_names import cacheable
from kvwire.observability.labels import InstanceState, KVEventKind, PathReason, ProxyPath, RequestStatus
from kvwire.observability.metrics import CONTENT_TYPE, Metrics, process_metrics
from kvwire.router.body_limit import BodyLimit
from kvwire.router.config import VLLMRouterConfig
from kvwire.router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, follow
from kvwire.router.not_served import answer_not_served
from kvwire.router.schemas import APIError
from kvwire.router.vllm import http as http
from kvwire.router.vllm import upstream as upstream
from kvwire.router.vllm.adapters import LOAD, UNLOAD, Adapters
from kvwire.router.vllm.answers import Answers, Call
from kvwire.router.vllm.bodies import (
    Endpoint,
    Producer,
    ahead_params,
    choices,
    decode_body,
    decode_only_reason,
    is_stream,
    parse_body,
)
from kvwire.router.vllm.cache_scope import ModelCards
from kvwire.router.vllm.load import scrape
from kvwire.router.vllm.pass_on import PASSED_ON_PATHS, PassOn
from kvwire.router.vllm.pool import HealthProbe, InstancePool, Tolerance, run_health_checks
from kvwire.router.vllm.prefill import Prefilled, PrefillStep, record_failure
from kvwire.router.vllm.schedule import Placement, Scheduler
from kvwire.router.vllm.stored import StoredResponses
from kvwire.router.vllm.tokens import PromptReader
from kvwire.router.vllm.upstream import InstanceError, unsent

log = logging.getLogger(__name__)
_FIRST_RETRY_S = 0.05  # back-off before a request tries an instance again, doubled each time up to _LAST_RETRY_S
_LAST_RETRY_S = 1.0
_EVENT_KINDS = {BlockStored: KVEventKind.STORED, BlockRemoved: KVEventKind.REMOVED,
                AllBlocksCleared: KVEventKind.CLEARED}


class VLLMRouter:
    """The route handlers, over one connection pool and the two instance pools."""

    def __init__(self, config: VLLMRouterConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        tolerance = Tolerance(config.max_failures, config.unresponsive_s)
        self.prefill = InstancePool(NodeRole.PREFILL, config.prefill_urls, tolerance=tolerance)
        self.decode = InstancePool(NodeRole.DECODE, config.decode_urls, tolerance=tolerance)
        self._prefill_step = PrefillStep(self.prefill, metrics)
        self.schedule = Scheduler(config.routing, config.decode_only_below, config.prefix_ttl_s, self.prefill,
                                  self.decode)
        self._client: httpx2.AsyncClient | None = None
        self._behind: set[asyncio.Task] = set()  # prefill steps, GET /v1/models: running past their request
        self._prompts = PromptReader(metrics)
        self.cards = ModelCards()
        self.stored = StoredResponses()
        self._answers = Answers(metrics, self.decode, self.schedule, self.stored)
        self.pass_on = PassOn(lambda: self.client, self.decode, metrics, self.stored)
        self.adapters = Adapters(lambda: self.client, (self.prefill, self.decode), metrics)
        for pool in (self.prefill, self.decode):
            metrics.watch_instances(str(pool.role), pool.count)

    @property
    def client(self) -> httpx2.AsyncClient:
        assert self._client is not None  # the lifespan opens it before serving
        return self._client

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        connect = self.config.connect_timeout_s
        timeout = httpx2.Timeout(self.config.request_timeout_s, connect=connect)
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)  # streams hold theirs
        async with httpx2.AsyncClient(timeout=timeout, limits=limits) as client:
            self._client = client
            probe_s = max(self.config.health_interval_s, connect)  # answered before the next probe is due
            probe_timeout = httpx2.Timeout(probe_s, connect=connect)
            probe = HealthProbe(client, probe_timeout)

            async def load(url: str):
                return await scrape(client, url, probe_timeout)

            pools = (self.prefill, self.decode)
            await asyncio.gather(*(pool.check(probe, load) for pool in pools))  # serve knowing who is up
            await self.cards.learn(client, self.decode.urls(InstanceState.UP), {}, probe_timeout)
            checks = asyncio.create_task(run_health_checks(pools, probe, self.config.health_interval_s, load,
                                                           self._back))
            events = [asyncio.create_task(follow(endpoint, url, self._kv_events))
                      for url, endpoint in zip(self.config.decode_urls, self.config.decode_kv_events) if endpoint]
            try:
                yield
            finally:
                for task in (checks, *events, *self._behind):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _back(self, pool: InstancePool, urls: Sequence[str]) -> None:
        """Instances `urls` of `pool` came back into rotation, perhaps restarted: what they held is forgotten, and
        the adapters loaded through the router are given to them (in the background: the health checks go on)."""
        self.schedule.back(pool.role, urls)
        task = asyncio.create_task(self.adapters.give(pool, urls))
        self._behind.add(task)
        task.add_done_callback(self._behind.discard)

    def _kv_events(self, url: str, events: Sequence[KVEvent]) -> None:
        for event in events:
            self.metrics.vllm_kv_events.labels(str(_EVENT_KINDS[type(event)])).inc()
        self.schedule.kv_events(url, events)

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

    async def completions(self, request: Request):
        return await self._unless_client_leaves(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: Request):
        return await self._unless_client_leaves(request, Endpoint.CHAT)

    async def responses(self, request: Request):
        return await self._unless_client_leaves(request, Endpoint.RESPONSES)

    async def messages(self, request: Request):
        return await self._unless_client_leaves(request, Endpoint.MESSAGES)

    async def _unless_client_leaves(self, request: Request, endpoint: Endpoint) -> Response:
        """`_generate`, cancelled (and with it every call to an instance, which vLLM then aborts) if the client
        goes away before the answer starts; a stream's relay is stopped by Starlette itself."""
        started = time.monotonic()
        rid = http.request_id(request)
        if trace := http.trace_id(request):  # passed on to the instances too (http.PASSED_ON)
            log.info("request %s: trace %s", rid, trace)
        raw = await request.body()  # read before waiting for the disconnect: both come from receive()
        answer = asyncio.create_task(self._generate(request, endpoint, rid, raw, started))
        gone = asyncio.create_task(http.client_gone(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answer
            log.info("request %s: the client went away; its calls to vLLM instances are cancelled", rid)
            self.metrics.requests.labels(str(RequestStatus.CANCELLED)).inc()
            return Response(status_code=499)  # nobody reads it
        return answer.result()

    async def _generate(self, request: Request, endpoint: Endpoint, rid: str, raw: bytes, started: float) -> Response:
        try:
            body = parse_body(raw)
            deadline = started + self.config.instance_wait_s
            await self._wait_for_decode(rid, deadline)
            headers = http.upstream_headers(request, rid)
            call = await self._read_prompt(Call(rid, endpoint, body, headers, started, deadline,
                                                 scope=self._scope_of(body, headers)))
            placed = self.schedule.place(call.tokens, scope=call.scope)
            if placed is None:
                raise http.no_decode(rid)
            if (reason := decode_only_reason(body, endpoint)) is not None:
                home = self.stored.home_of(body)  # a later Responses turn: where the earlier one is stored
                if home in self.decode.urls(InstanceState.UP):
                    placed = placed._replace(decode=home)
                return await self._decode(call, Prefilled(None, reason), placed)
            if placed.decode_only is not None:
                return await self._decode(call, Prefilled(None, placed.decode_only), placed)
            url = self.schedule.prefill(call.tokens, placed.decode, call.scope)
            if isinstance(url, PathReason):
                return await self._decode(call, Prefilled(None, url), placed)
            limit = self.config.prefill_max_in_flight
            if limit and self.prefill.in_flight(url) >= limit:  # the least loaded one: every one is
                return await self._decode(call, Prefilled(None, PathReason.PREFILL_SATURATED), placed)
            self.schedule.sent(NodeRole.PREFILL, url, call.tokens, call.scope)
            producer = self._prefill_step.producer(url)
            if producer is not None and not self.config.sequential:
                return await self._alongside(call, url, producer, placed)
            prefilled = await self._prefill_step.run(self.client, rid, url, endpoint, body, call.headers)
            if prefilled.refusal is not None:
                self._answers.count(prefilled.refusal.status_code)
                return http.whole(prefilled.refusal, rid, {})
            return await self._decode(call, prefilled, placed)
        except APIError as exc:
            self._answers.count(exc.status)
            return JSONResponse(exc.body(), status_code=exc.status, headers={"x-request-id": rid})
        except Exception:
            self._answers.count(500)
            raise

    async def _wait_for_decode(self, rid: str, deadline: float) -> None:
        """Returns once a decode instance is up. Raises: APIError(503) when none is by `deadline`."""
        if not await self.decode.wait_up(deadline - time.monotonic()):
            raise http.no_decode(rid)

    def _scope_of(self, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        """The body's cache scope; the base model's names asked for first, in the background, when not known yet."""
        if self.cards.due() and (up := self.decode.urls(InstanceState.UP)):
            timeout = httpx2.Timeout(max(self.config.health_interval_s, self.config.connect_timeout_s))
            task = asyncio.create_task(self.cards.learn(self.client, up, headers, timeout))
            self._behind.add(task)
            task.add_done_callback(self._behind.discard)
        return self.cards.scope_of(body)

    async def _read_prompt(self, call: Call) -> Call:
        """`call` with its prompt's token ids, when the scheduler needs them and an instance tokenizes them."""
        if not self.schedule.reads_prompts() or not (up := self.decode.urls(InstanceState.UP)):
            return call
        return call._replace(tokens=await self._prompts.read(self.client, call.rid, up, call.endpoint, call.body,
                                                             call.headers))

    async def _alongside(self, call: Call, url: str, producer: Producer, placed: Placement) -> Response:
        """The prefill and the decode step at once (module docstring, ALONGSIDE)."""
        key = f"kvwire-{uuid.uuid4().hex}"
        prefill = asyncio.create_task(self._prefill_step.run(self.client, call.rid, url, call.endpoint, call.body,
                                                             call.headers, key))
        ahead = Prefilled(ahead_params(key, producer), PathReason.PREFILLED_ALONGSIDE, url)
        decode = asyncio.create_task(self._decode(call, ahead, placed))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() and prefill.result().kv_transfer_params is None:
                decode.cancel()  # the KV will not come: vLLM aborts the request the router stops waiting for
                with contextlib.suppress(asyncio.CancelledError):
                    await decode
                reason = prefill.result().reason
                log.warning("request %s: prefill instance %s gave no KV (%s); decode-only", call.rid, url, reason)
                return await self._decode(call, Prefilled(None, reason, url), placed)
            return await decode
        except BaseException:
            decode.cancel()  # the client went away (or the router failed): vLLM aborts the decode request too
            raise
        finally:
            if not prefill.done():  # it ends on its own (its KV lapses at the producer's hold deadline)
                self._behind.add(prefill)
                prefill.add_done_callback(self._behind.discard)

    async def _decode(self, call: Call, prefilled: Prefilled, placed: Placement) -> Response:
        """The decode instance `placed` names answers the request, or the first other one that takes it (module
        docstring, steps 4 and 5)."""
        body = decode_body(call.body, prefilled.kv_transfer_params)
        stream = is_stream(body)
        send = upstream.open_stream if stream else upstream.post
        tried: set[str] = set()
        delay, last, blocks = _FIRST_RETRY_S, None, placed.blocks
        url: str | None = placed.decode
        checked = prefilled.reason == PathReason.CACHED_ON_DECODE  # its answer's cached tokens against the held
        while True:
            if url is not None:
                self.decode.started(url, blocks)
                self.schedule.sent(NodeRole.DECODE, url, call.tokens, call.scope)
                headers = call.headers
                if choices(body) > 1 and (engine := self.decode.engine_for(url)) is not None:
                    headers = headers | {http.DP_RANK: str(engine)}  # one engine pulls the KV, once, for all
                try:
                    resp = await send(self.client, call.rid, url, call.endpoint, body, headers)
                    size = self.decode.block_size_of(url) or 1
                    held = min(placed.held, cacheable(len(call.tokens or ()), size)) if checked else 0
                    if not stream or resp.status_code != 200:
                        self.decode.ended(url, blocks)
                        return self._answers.whole(resp, call, url, prefilled, held)
                    return await self._answers.stream(resp, call, url, prefilled, blocks, held)
                except InstanceError as exc:
                    self.decode.ended(url, blocks)
                    record_failure(self.metrics, self.decode, url, exc)
                    if not unsent(exc.kind):
                        raise http.failed(exc) from None
                    log.warning("%s; trying again", exc)
                    tried.add(url)
                    last = exc
                except asyncio.CancelledError:
                    self.decode.ended(url, blocks)
                    raise
            if time.monotonic() + delay > call.deadline:
                raise http.no_decode(call.rid) if last is None else http.failed(last)
            await asyncio.sleep(delay)
            delay = min(2 * delay, _LAST_RETRY_S)
            again = self.schedule.place(call.tokens, frozenset(tried), call.scope)
            url, placed = (again.decode, again) if again else (None, placed)


def create_vllm_app(config: VLLMRouterConfig, metrics: Metrics | None = None) -> FastAPI:
    """The router's app in front of vLLM; its metrics go to `metrics`, this process's by default."""
    router = VLLMRouter(config, metrics or process_metrics())
    app = FastAPI(title="kvwire router (vLLM)", lifespan=router.lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_api_route("/healthz", router.healthz, methods=["GET"])
    app.add_api_route("/readyz", router.readyz, methods=["GET"])
    app.add_api_route("/health", router.readyz, methods=["GET"])  # vLLM's name: what a probe of vLLM asks
    app.add_api_route("/metrics", router.metrics_text, methods=["GET"])
    for path in ("/v1/models", "/version"):
        app.add_api_route(path, router.pass_on.to_any, methods=["GET"])
    app.add_api_route(str(Endpoint.COMPLETIONS), router.completions, methods=["POST"])
    app.add_api_route(str(Endpoint.CHAT), router.chat_completions, methods=["POST"])
    app.add_api_route(str(Endpoint.RESPONSES), router.responses, methods=["POST"])
    app.add_api_route(str(Endpoint.MESSAGES), router.messages, methods=["POST"])
    for path in PASSED_ON_PATHS:
        app.add_api_route(path, router.pass_on.to_any, methods=["POST"])
    app.add_api_route(LOAD, router.adapters.load, methods=["POST"])
    app.add_api_route(UNLOAD, router.adapters.unload, methods=["POST"])
    app.add_api_route(f"{Endpoint.RESPONSES}/{{response_id}}", router.pass_on.to_holder, methods=["GET"])
    app.add_api_route(f"{Endpoint.RESPONSES}/{{response_id}}/cancel", router.pass_on.to_holder, methods=["POST"])
    app.add_exception_handler(APIError, http.api_error)
    answer_not_served(app)
    return app
