"""The router's HTTP API: POST /v1/completions, GET /v1/models, /healthz, /readyz, /metrics.

Lifecycle of the app:

1. `create_app(config)` builds the app around one `Router`.
2. On startup the router opens the directory and the dispatcher.
3. While it serves, each completion is tokenized here, dispatched to one prefill and one
   decode node, and answered whole or streamed as server-sent events, with a `kvwire`
   object telling how its KV travelled.
4. On shutdown it closes the dispatcher and the directory.

Each answer counts in kvwire_requests_total{status}; each successful one's time to its
first token, from the router's point of view, in kvwire_ttft_seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory import DirectoryError, KVDirectory
from kvwire.connectors.wire import ErrorKind, SamplingParams, TokenChunk, WorkError
from kvwire.engine.loader import load_config
from kvwire.engine.tokenizer import load_tokenizer
from kvwire.engine.validation import prompt_problem
from kvwire.observability.labels import RequestStatus
from kvwire.observability.metrics import CONTENT_TYPE, Metrics, process_metrics
from kvwire.router.config import RouterConfig
from kvwire.router.dispatch import Dispatcher
from kvwire.router.schemas import APIError, CompletionRequest, parse_request


class Completion:
    """One request's accumulating result."""

    def __init__(self, request_id: str, req: CompletionRequest, prompt_ids: list[int], tokenizer, started: float):
        self.request_id = request_id
        self.req = req
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.started = started
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self.final: TokenChunk | None = None

    def add(self, chunk: TokenChunk) -> str:
        """Record a chunk; return the new text it adds."""
        if self.first_token_at is None and chunk.token_ids:
            self.first_token_at = time.monotonic()
        before = self.tokenizer.decode(self.token_ids)
        self.token_ids.extend(chunk.token_ids)
        if chunk.finished:
            self.final = chunk
        return self.tokenizer.decode(self.token_ids)[len(before):]

    def kvwire(self) -> dict:
        stats = self.final.stats if self.final else None
        ttft = (self.first_token_at - self.started) * 1000 if self.first_token_at else None
        out: dict[str, object] = {"bypassed": False, "transport": None, "kv_bytes": 0, "transfer_ms": 0.0,
                                  "ttft_ms": ttft, "prefill_node": None, "decode_node": None}
        if stats is not None:
            out.update(bypassed=stats.bypassed, transport=stats.transport or None, kv_bytes=stats.kv_bytes,
                       transfer_ms=stats.transfer_ms, prefill_node=stats.prefill_node, decode_node=stats.decode_node,
                       decode_ttft_ms=stats.ttft_ms)
        return out

    def choice(self, text: str, finished: bool) -> dict:
        c = {"index": 0, "text": text, "logprobs": None,
             "finish_reason": self.final.finish_reason if finished and self.final else None}
        if self.req.return_token_ids:
            c["token_ids"] = list(self.token_ids) if finished else None
        return c

    def body(self, model: str, choice: dict, final: bool) -> dict:
        out = {"id": self.request_id, "object": "text_completion", "created": int(time.time()),
               "model": model, "choices": [choice]}
        if final:
            n = len(self.token_ids)
            out["usage"] = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n,
                            "total_tokens": len(self.prompt_ids) + n}
            out["kvwire"] = self.kvwire()
        return out


class Router:
    """The route handlers, over one tokenizer, one directory client and one dispatcher."""

    def __init__(self, config: RouterConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.tokenizer = load_tokenizer(config.model_dir)
        self.model_config = load_config(config.model_dir)
        self.max_len = self.model_config.max_position_embeddings
        self.directory: KVDirectory | None = None
        self.dispatcher: Dispatcher | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.directory = KVDirectory(self.config.redis_url, metrics=self.metrics)
        self.dispatcher = Dispatcher(self.directory, self.config.host)
        self.dispatcher.start()
        yield
        await self.dispatcher.close()
        self.directory.close()

    async def healthz(self):
        dispatcher = self.dispatcher
        assert dispatcher is not None  # lifespan opened it before serving
        counts = {r.value: len(await asyncio.to_thread(dispatcher.live_nodes, r)) for r in NodeRole}
        ok = all(counts.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "nodes": counts}, status_code=200 if ok else 503)

    async def readyz(self):
        """200 when the directory answers and lists at least one live decode node; 503 otherwise."""
        directory = self.directory
        assert directory is not None  # lifespan opened it before serving
        try:
            decode_nodes = await asyncio.to_thread(directory.live_nodes, NodeRole.DECODE)
        except DirectoryError as exc:
            return JSONResponse({"ready": False, "reason": str(exc)}, status_code=503)
        ready = bool(decode_nodes)
        return JSONResponse({"ready": ready, "decode_nodes": len(decode_nodes)}, status_code=200 if ready else 503)

    async def metrics_text(self):
        return Response(content=self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(self):
        return {"object": "list", "data": [{"id": self.config.served_model_name, "object": "model",
                                            "owned_by": "kvwire", "max_model_len": self.max_len}]}

    async def completions(self, request: Request):
        started = time.monotonic()
        try:
            return await self._complete(request, started)
        except APIError as exc:
            self.metrics.requests.labels(str(_status(exc))).inc()
            raise
        except Exception:
            self.metrics.requests.labels(str(RequestStatus.ERROR)).inc()
            raise

    def _answered(self, comp: Completion, status: RequestStatus) -> None:
        self.metrics.requests.labels(str(status)).inc()
        if status == RequestStatus.OK and comp.first_token_at is not None:
            self.metrics.ttft_seconds.observe(comp.first_token_at - comp.started)

    async def _complete(self, request: Request, started: float):
        req = parse_request(await request.body(), self.max_len)
        prompt_ids = self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        _check_prompt(prompt_ids, req, self.max_len, self.model_config.vocab_size)
        rid = f"cmpl-{uuid.uuid4().hex}"
        dispatcher = self.dispatcher
        assert dispatcher is not None  # lifespan opened it before serving
        sampling = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  seed=req.seed)
        _, queue = await dispatcher.submit(rid, prompt_ids, sampling, req.disaggregate)
        comp = Completion(rid, req, prompt_ids, self.tokenizer, started)
        deadline = started + self.config.request_timeout_s
        model = self.config.served_model_name
        if req.stream:
            return StreamingResponse(_stream(comp, queue, deadline, dispatcher, model, self._answered),
                                     media_type="text/event-stream")
        try:
            async for _ in _chunks(comp, queue, deadline):
                pass
        finally:
            dispatcher.forget(rid)
        self._answered(comp, RequestStatus.OK)
        return comp.body(model, comp.choice(self.tokenizer.decode(comp.token_ids), finished=True), final=True)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)  # the handler of APIError only
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(config: RouterConfig, metrics: Metrics | None = None) -> FastAPI:
    """The router's app; its metrics go to `metrics`, this process's by default."""
    router = Router(config, metrics or process_metrics())
    app = FastAPI(title="kvwire router", lifespan=router.lifespan)
    app.add_exception_handler(APIError, _api_error)
    app.add_api_route("/healthz", router.healthz, methods=["GET"])
    app.add_api_route("/readyz", router.readyz, methods=["GET"])
    app.add_api_route("/metrics", router.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/v1/completions", router.completions, methods=["POST"])
    return app


def _status(exc: APIError) -> RequestStatus:
    return {400: RequestStatus.INVALID, 503: RequestStatus.UNAVAILABLE, 504: RequestStatus.TIMEOUT}.get(
        exc.status, RequestStatus.ERROR)


def _check_prompt(prompt_ids: list[int], req: CompletionRequest, max_len: int, vocab: int) -> None:
    problem = prompt_problem(prompt_ids, vocab, max_len, req.max_tokens)
    if problem:
        raise APIError(400, problem, param="prompt")


async def _chunks(comp: Completion, queue: asyncio.Queue, deadline: float):
    """Yield the text each chunk adds until the final one. Raises APIError on failure or timeout."""
    while comp.final is None:
        try:
            msg = await asyncio.wait_for(queue.get(), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise APIError(504, f"request {comp.request_id} timed out", type_="timeout") from None
        if isinstance(msg, WorkError):
            if msg.kind == ErrorKind.INVALID_REQUEST:
                raise APIError(400, msg.reason)
            if msg.kind in (ErrorKind.DRAINING, ErrorKind.NODE_LOST):  # retryable: send it again
                raise APIError(503, f"node {msg.node}: {msg.reason}", type_="service_unavailable")
            raise APIError(500, f"node {msg.node}: {msg.reason}", type_="server_error")
        yield comp.add(msg)


async def _stream(comp: Completion, queue: asyncio.Queue, deadline: float, dispatcher: Dispatcher, model: str,
                  answered: Callable[[Completion, RequestStatus], None]):
    try:
        async for delta in _chunks(comp, queue, deadline):
            final = comp.final is not None
            yield f"data: {json.dumps(comp.body(model, comp.choice(delta, final), final))}\n\n"
        answered(comp, RequestStatus.OK)
    except APIError as exc:
        answered(comp, _status(exc))
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:
        dispatcher.forget(comp.request_id)
    yield "data: [DONE]\n\n"
