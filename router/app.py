"""The router's HTTP API: POST /v1/completions, /v1/chat/completions, /v1/responses (router/responses_api.py),
/v1/messages and its count_tokens (router/messages_api.py), /tokenize and /detokenize; GET /v1/models,
/healthz, /readyz, /metrics.

Lifecycle of the app:

1. `create_app(config)` builds the app around one `Router`.
2. On startup the router opens the directory and the dispatcher.
3. While it serves, each request is checked (router/schemas.py, router/sampling.py: every parameter is
   applied or refused), its prompts tokenized (a chat's messages rendered with the checkpoint's template
   first), and each of its choices dispatched to one prefill and one decode node (router/generation.py).
   It is answered whole or streamed as server-sent events (router/responses.py), with a `kvwire` object
   telling how the KV travelled. A client's W3C `traceparent` / `tracestate` go on to the nodes (the trace
   id is logged with the request); with --otlp-traces-endpoint each choice is a "kvwire.route" span.
4. On shutdown it closes the dispatcher and the directory.

Each answer counts in kvwire_requests_total{status}; each successful one's time to its
first token, from the router's point of view, in kvwire_ttft_seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory
from kvwire.connectors.wire import models_agree
from kvwire.engine.model_config import load_config
from kvwire.engine.tokenizer import load_tokenizer
from kvwire.observability.labels import RequestStatus
from kvwire.observability.metrics import CONTENT_TYPE, Metrics, process_metrics
from kvwire.observability.tracing import Spans, TraceContext, trace_context, trace_id
from kvwire.router import tokenize_routes
from kvwire.router.api_adapter import EventShaper, named_sse
from kvwire.router.body_limit import BodyLimit
from kvwire.router.chat_template import ChatTemplate
from kvwire.router.choice import Choice
from kvwire.router.config import RouterConfig
from kvwire.router.dispatch import Dispatcher
from kvwire.router.generation import Generation
from kvwire.router.messages_api import MESSAGES, MessageShaper, MessagesRequest, count_chat
from kvwire.router.not_served import answer_not_served
from kvwire.router.responses import Api, Shaper
from kvwire.router.responses_api import RESPONSES
from kvwire.router.sampling import Limits, Plan, chat_plan, completion_plan
from kvwire.router.schemas import APIError, ChatRequest, CompletionRequest, parse_body

log = logging.getLogger(__name__)
_ADAPTERS = {Api.RESPONSES: RESPONSES, Api.MESSAGES: MESSAGES}  # the APIs served as chat requests


class Router:
    """The route handlers, over one tokenizer, one directory client and one dispatcher."""

    def __init__(self, config: RouterConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.tokenizer = load_tokenizer(config.model_dir)
        self.model_config = load_config(config.model_dir)
        self.max_len = self.model_config.max_position_embeddings
        self.chat_template = ChatTemplate(config.model_dir)
        self.directory: KVDirectory | None = None
        self.dispatcher: Dispatcher | None = None
        self.spans = Spans()  # opened with the app (lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.spans = Spans.open("kvwire-router", self.config.traces_endpoint)
        self.directory = KVDirectory(self.config.redis_url, metrics=self.metrics)
        self.dispatcher = Dispatcher(self.directory, self.config.host, decode_only_below=self.config.decode_only_below,
                                     prefill_max_in_flight=self.config.prefill_max_in_flight,
                                     routing=self.config.routing, prefix_ttl_s=self.config.prefix_ttl_s)
        self.dispatcher.start()
        yield
        await self.dispatcher.close()
        self.directory.close()
        self.spans.close()

    async def healthz(self):
        dispatcher = self.dispatcher
        assert dispatcher is not None  # lifespan opened it before serving
        counts = {r.value: len(await asyncio.to_thread(dispatcher.live_nodes, r)) for r in NodeRole}
        ok = all(counts.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "nodes": counts}, status_code=200 if ok else 503)

    async def readyz(self):
        """Whether the router can serve (200: the directory answers and lists a live decode node; 503 otherwise)
        and, in the body, whether it can disaggregate now (`disaggregate`: a live prefill node too, of the checkpoint
        of a live decode node: `reason` says when none is).

        A router with decode nodes alone serves every request (decode-only, recomputed), so it stays ready
        when no prefill node is live: `disaggregate: false` says so, for what waits for disaggregation (`kvwire
        demo`, a deploy's smoke test). Read from the directory at each call (picks reuse a read for a moment).
        """
        directory = self.directory
        assert directory is not None  # lifespan opened it before serving
        try:
            nodes = await asyncio.to_thread(directory.live_nodes)
        except DirectoryError as exc:
            return JSONResponse({"ready": False, "disaggregate": False, "reason": str(exc)}, status_code=503)
        decodes = [n for n in nodes if n.role == NodeRole.DECODE]
        prefills = [n for n in nodes if n.role == NodeRole.PREFILL]
        paired = any(models_agree(p.model, d.model) for p in prefills for d in decodes)
        body: dict[str, object] = {"ready": bool(decodes), "disaggregate": paired, "decode_nodes": len(decodes),
                                   "prefill_nodes": len(prefills)}
        if prefills and decodes and not paired:
            body["reason"] = "no live prefill node serves a decode node's checkpoint (kvwire status: MODEL)"
        return JSONResponse(body, status_code=200 if decodes else 503)

    async def metrics_text(self):
        return Response(content=self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(self):
        names = self.config.served_model_names or (self.config.served_model_name,)
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "kvwire",
                                            "max_model_len": self.max_len} for name in names]}

    async def tokenize(self, request: Request):
        return await tokenize_routes.tokenize(self, await request.body())

    async def detokenize(self, request: Request):
        return tokenize_routes.detokenize(self, await request.body())

    async def completions(self, request: Request):
        return await self._serve(request, Api.COMPLETIONS)

    async def chat(self, request: Request):
        return await self._serve(request, Api.CHAT)

    async def responses(self, request: Request):
        return await self._serve(request, Api.RESPONSES)

    async def messages(self, request: Request):
        try:
            return await self._serve(request, Api.MESSAGES)
        except APIError as exc:  # in Anthropic's shape, which its clients read
            return JSONResponse(MessageShaper.error_body(exc), status_code=exc.status)

    async def count_tokens(self, request: Request):
        """Anthropic's POST /v1/messages/count_tokens: the prompt's tokens, rendered as /v1/messages renders it."""
        try:
            chat = count_chat(parse_body(await request.body(), MessagesRequest, self.config.lenient))
            self.check_model(chat.model)
            text = await asyncio.to_thread(self.chat_template.render, chat)
        except APIError as exc:
            return JSONResponse(MessageShaper.error_body(exc), status_code=exc.status)
        return {"input_tokens": len(self.tokenizer.encode(text, add_special_tokens=False))}

    async def _serve(self, request: Request, api: Api):
        started = time.monotonic()
        trace = trace_context(request.headers.get("traceparent"), request.headers.get("tracestate"))
        answer = self._respond if api in _ADAPTERS else self._answer
        try:
            return await answer(await request.body(), api, started, trace)
        except APIError as exc:
            self.metrics.requests.labels(str(_status(exc))).inc()
            raise
        except Exception:
            self.metrics.requests.labels(str(RequestStatus.ERROR)).inc()
            raise

    def _answered(self, gen: Generation, started: float, status: RequestStatus) -> None:
        self.metrics.requests.labels(str(status)).inc()
        firsts = [c.first_token_at for c in gen.choices if c.first_token_at is not None]
        if status == RequestStatus.OK and firsts:
            self.metrics.ttft_seconds.observe(min(firsts) - started)

    async def _plan(self, body: bytes, api: Api) -> tuple[Plan, list[str]]:
        """The request's plan and its prompts' texts (for echo)."""
        if api == Api.CHAT:
            return await self._chat_plan(parse_body(body, ChatRequest, self.config.lenient)), []
        limits = Limits(self.max_len, self.model_config.vocab_size)
        req = parse_body(body, CompletionRequest, self.config.lenient)
        self.check_model(req.model)
        prompts = _prompt_list(req.prompt)
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if req.echo else []
        return completion_plan(req, ids, limits), texts

    async def _chat_plan(self, chat: ChatRequest) -> Plan:
        self.check_model(chat.model)
        text = await asyncio.to_thread(self.chat_template.render, chat)
        return chat_plan(chat, self.tokenizer.encode(text, add_special_tokens=False),
                         Limits(self.max_len, self.model_config.vocab_size))

    def check_model(self, model: str | None) -> None:
        if model is not None and not self.config.serves(model):
            raise APIError(404, f"The model `{model}` does not exist; this router serves "
                                f"`{self.config.served_model_name}`.", param="model", code="model_not_found")

    async def _answer(self, body: bytes, api: Api, started: float, trace: TraceContext | None):
        plan, texts = await self._plan(body, api)
        rid = f"{'chatcmpl' if api == Api.CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        gen = await self._start(plan, rid, texts, started, trace)
        shaper = Shaper(api, rid, self.config.served_model_name, plan, self.tokenizer)
        if plan.stream:
            return StreamingResponse(self._stream(gen, shaper, started), media_type="text/event-stream")
        choices = await self._finished(gen, started)
        return shaper.whole(choices, _usage(gen), _kvwire(choices, started))

    async def _respond(self, body: bytes, api: Api, started: float, trace: TraceContext | None):
        """A Responses or Messages API request (router/api_adapter.py), run as the chat request it stands for."""
        adapter = _ADAPTERS[api]
        req: Any = parse_body(body, adapter.request, self.config.lenient)
        try:
            plan = await self._chat_plan(adapter.as_chat(req))
        except APIError as exc:
            raise adapter.renamed(exc) from None
        shaper = adapter.shaper(req, self.config.served_model_name, len(plan.prompts[0]))
        gen = await self._start(plan, shaper.id, [], started, trace)
        if plan.stream:
            return StreamingResponse(self._stream_events(gen, shaper, started), media_type="text/event-stream")
        choices = await self._finished(gen, started)
        return shaper.whole(choices[0], _usage(gen), _kvwire(choices, started))

    async def _finished(self, gen: Generation, started: float) -> list[Choice]:
        """A whole answer's choices, ranked, once every one has ended."""
        try:
            async for _ in gen.events():
                pass
        finally:
            gen.close()
        self._answered(gen, started, RequestStatus.OK)
        return gen.ranked()

    async def _stream_events(self, gen: Generation, shaper: EventShaper, started: float):
        """A Responses or Messages API stream: its events as the choice's text comes."""
        status = RequestStatus.OK
        try:
            for event in shaper.opening():
                yield named_sse(event)
            async for choice in gen.events():
                if (delta := shaper.delta(choice.stream_delta()[0])) is not None:
                    yield named_sse(delta)
                if choice.finished:
                    for event in shaper.closing(choice, _usage(gen), _kvwire(gen.choices, started)):
                        yield named_sse(event)
        except APIError as exc:
            status = _status(exc)
            yield named_sse(shaper.error(exc))
        except (asyncio.CancelledError, GeneratorExit):
            status = RequestStatus.CANCELLED  # the client left: close() stops its choice on the nodes
            raise
        finally:
            gen.close()
            self._answered(gen, started, status)

    async def _start(self, plan: Plan, rid: str, texts: list[str], started: float,
                     trace: TraceContext | None) -> Generation:
        """The request's choices, each dispatched (its path and reason counted)."""
        if trace is not None:
            log.info("request %s: trace %s", rid, trace_id(trace))
        dispatcher = self.dispatcher
        assert dispatcher is not None  # lifespan opened it before serving

        def make_choice(k: int, sub_id: str, prompt: list[int]) -> Choice:
            echo = texts[k // plan.best_of] if plan.echo else ""
            return Choice(k, sub_id, prompt, plan, self.tokenizer, echo)

        gen = Generation(dispatcher, plan, rid, started + self.config.request_timeout_s, make_choice, self.spans,
                         trace)
        try:
            await gen.start()
        except BaseException:
            gen.close()
            raise
        for choice in gen.choices:  # each dispatched: its path and reason set
            self.metrics.path_reasons.labels(str(choice.path), str(choice.reason)).inc()
        return gen

    async def _stream(self, gen: Generation, shaper: Shaper, started: float):
        status = RequestStatus.OK
        try:
            shown: set[int] = set()
            async for choice in gen.events():
                chunk = shaper.chunk(choice, first=choice.index not in shown)
                if chunk is not None:
                    shown.add(choice.index)
                    if choice.finished:
                        chunk["kvwire"] = _report(choice, started)
                    yield _sse(chunk)
            if shaper.plan.include_usage:
                yield _sse(shaper.usage_chunk(_usage(gen), _kvwire(gen.choices, started)))
        except APIError as exc:
            status = _status(exc)
            yield _sse(exc.body())
        except (asyncio.CancelledError, GeneratorExit):
            status = RequestStatus.CANCELLED  # the client left: close() stops its choices on the nodes
            raise
        finally:
            gen.close()
            self._answered(gen, started, status)
        yield "data: [DONE]\n\n"


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)  # the handler of APIError only
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(config: RouterConfig, metrics: Metrics | None = None) -> FastAPI:
    """The router's app; its metrics go to `metrics`, this process's by default."""
    router = Router(config, metrics or process_metrics())
    app = FastAPI(title="kvwire router", lifespan=router.lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_exception_handler(APIError, _api_error)
    app.add_api_route("/healthz", router.healthz, methods=["GET"])
    app.add_api_route("/readyz", router.readyz, methods=["GET"])
    app.add_api_route("/health", router.readyz, methods=["GET"])  # vLLM's name: what a probe of vLLM asks
    app.add_api_route("/metrics", router.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/v1/completions", router.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", router.chat, methods=["POST"])
    app.add_api_route("/v1/responses", router.responses, methods=["POST"])
    app.add_api_route("/v1/messages", router.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", router.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", router.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", router.detokenize, methods=["POST"])
    answer_not_served(app)
    return app


def _status(exc: APIError) -> RequestStatus:
    statuses = {400: RequestStatus.INVALID, 404: RequestStatus.INVALID, 503: RequestStatus.UNAVAILABLE,
                504: RequestStatus.TIMEOUT}
    return statuses.get(exc.status, RequestStatus.ERROR)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A completions prompt as a list of prompts, each a text or token ids. Raises APIError(400) for a mix."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return list(prompt)
    raise APIError(400, "prompt must be a non-empty text, list of token ids, list of texts or list of token-id "
                        "lists", param="prompt")


def _usage(gen: Generation) -> dict:
    prompt = sum(len(p) for p in gen.plan.prompts)
    completion = sum(len(c.token_ids) for c in gen.choices)
    # per prompt, as vLLM counts its one prefill of it: the prompt's first choice's (n > 1 runs one per choice)
    firsts = [c for c in gen.choices if c.index % gen.plan.best_of == 0]
    cached = sum(c.stats.cached_tokens for c in firsts if c.stats is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _report(choice: Choice, started: float) -> dict:
    """How one choice's KV travelled."""
    stats = choice.stats
    ttft = (choice.first_token_at - started) * 1000 if choice.first_token_at else None
    out: dict[str, object] = {"bypassed": False, "transport": None, "kv_bytes": 0, "transfer_ms": 0.0,
                              "ttft_ms": ttft, "prefill_node": None, "decode_node": None,
                              "path": choice.path and str(choice.path), "reason": choice.reason and str(choice.reason)}
    if stats is not None:
        out.update(bypassed=stats.bypassed, transport=stats.transport or None, kv_bytes=stats.kv_bytes,
                   transfer_ms=stats.transfer_ms, prefill_node=stats.prefill_node or None,
                   decode_node=stats.decode_node, decode_ttft_ms=stats.ttft_ms, cached_tokens=stats.cached_tokens,
                   transfer_failure=stats.transfer_failure and str(stats.transfer_failure))
    return out


def _kvwire(choices: list[Choice], started: float) -> dict:
    """The first choice's report; with several, every choice's too, in index order."""
    reports = [_report(c, started) for c in sorted(choices, key=lambda c: c.index)]
    return reports[0] if len(reports) == 1 else {**reports[0], "choices": reports}


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

