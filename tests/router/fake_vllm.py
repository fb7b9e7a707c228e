"""A stand-in for a vLLM server's HTTP API, for the router's unit tests: real sockets, scripted behaviour.

`FakeVLLM(port)` serves in a thread once `start()`ed, until `stop()` (and may start again on the same port):
GET /health (after `health_delay_s`), GET /v1/models, and POST /v1/completions, /v1/chat/completions,
/v1/responses and /v1/messages, which answer after `answer_delay_s` (or not at all, once their client has gone
away), a Responses answer with an id (in a stream, its first event) that GET /v1/responses/{id} then finds:
- a prefill's body (`do_remote_decode`) as KvwireConnector's producer would: `kv_transfer_params` naming
  `name` and the `kvwire_key` it was given (none while `hands_out_params` is off; the HTTP status
  `prefill_status` instead of 200 when set);
- a decode's, `kv_wait_s` later if told of a remote prefill (waiting for its KV; given up, as vLLM aborts,
  when the client goes away: counted in `aborted`), with the `kv_transfer_params` it got echoed in its text;
  streams as two SSE chunks.
POST /v1/load_lora_adapter and /v1/unload_lora_adapter keep `adapters` (vLLM's answers, its refusals of an adapter
loaded twice or unloaded unknown; a load of a `lora_path` in `missing` is refused as vLLM refuses a path with no
adapter); a restart (`stop`, `start`) forgets them, as vLLM's runtime adapters are.
POST /detokenize answers a text naming it (no /tokenize: the router places by load alone, or by a prompt given as
token ids). A decode answer's usage says `cached_tokens` prompt tokens were read from the cache, when set.
`bodies` records what each POST carried, `headers` its headers. GET /metrics answers `metrics` (404 while it is "").
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.testclient import TestClient

from kvwire.observability.metrics import Metrics
from kvwire.router.config import VLLMRouterConfig
from kvwire.router.vllm.proxy import create_vllm_app

HEALTH_S = 0.1  # the router's health interval in the tests
CONNECT_S = 0.2  # its connect timeout, and so its probes' read timeout (the longer of the two)


def serve_in_thread(app: Any, port: int, name: str) -> tuple[uvicorn.Server, threading.Thread]:
    """`app` served on 127.0.0.1:`port` by uvicorn in a thread, once it listens. Stop: `should_exit`, join."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{name} did not start on port {port}")
        time.sleep(0.01)
    return server, thread


class FakeVLLM:
    def __init__(self, name: str, port: int):
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health_delay_s = 0.0
        self.answer_delay_s = 0.0
        self.kv_wait_s = 0.0  # more, for a decode body with do_remote_prefill: waiting for KV (that may never come)
        self.hands_out_params = True
        self.prefill_status = 200
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.aborted = 0  # decode calls whose client went away while they waited for KV
        self.metrics = ""  # its Prometheus exposition, as vLLM's GET /metrics ("": none, 404)
        self.scrapes = 0  # GET /metrics asked
        self.cached_tokens: int | None = None  # a decode answer's usage.prompt_tokens_details says (None: no usage)
        self.stored: set[str] = set()  # the ids of the Responses answers it stored (GET /v1/responses/{id})
        self.adapters: set[str] = set()  # the LoRA adapters loaded at run time
        self.missing: set[str] = set()  # lora_paths that hold no adapter
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeVLLM:
        self.adapters = set()
        self._server, self._thread = serve_in_thread(self._app(), self.port, f"fake-vllm-{self.name}")
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = self._thread = None

    @staticmethod
    async def _wait(request: Request, seconds: float) -> bool:
        """Wait `seconds`; False as soon as the client goes away (then nothing is left to answer, and a stop of
        this server does not wait for the rest of it)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.02)
        return True

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            await asyncio.sleep(self.health_delay_s)
            return JSONResponse({})

        @app.get("/metrics")
        async def metrics():
            self.scrapes += 1
            if not self.metrics:
                return JSONResponse({}, status_code=404)
            return PlainTextResponse(self.metrics)

        @app.get("/v1/models")
        async def models():
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "parent": None},
                                                            {"id": "sql", "object": "model", "parent": "fake"}]})

        async def generate(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if not await self._wait(request, self.answer_delay_s):
                return JSONResponse({}, status_code=499)
            params = body.get("kv_transfer_params") or {}
            prefill = bool(params.get("do_remote_decode"))
            if params.get("do_remote_prefill") and not await self._wait(request, self.kv_wait_s):
                self.aborted += 1  # as vLLM aborts a request whose client went away
                return JSONResponse({}, status_code=499)
            if prefill and self.prefill_status != 200:
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=self.prefill_status)
            text = f"{self.name} got {json.dumps(params, sort_keys=True)}"
            handed = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_num_tokens": 5,
                      "remote_request_id": params.get("kvwire_key", f"cmpl-{len(self.bodies)}"),
                      "remote_block_ids": [[1]], "remote_tp_size": 1, "transfer": "kvwire"}
            answer_id = self._answer_id(request, prefill, body)
            if body.get("stream") and not prefill:
                chunks = [f"data: {json.dumps({'choices': [{'text': t}]})}\n\n" for t in (self.name, " done")]
                if self.cached_tokens is not None:  # as stream_options.include_usage's last chunk
                    chunks.append(f"data: {json.dumps({'choices': [], 'usage': self._usage()})}\n\n")
                if answer_id:  # as the Responses API's first event
                    created = json.dumps({"response": {"id": answer_id}})
                    chunks.insert(0, f"event: response.created\ndata: {created}\n\n")
                return StreamingResponse(iter([*chunks, "data: [DONE]\n\n"]), media_type="text/event-stream")
            handed = handed if prefill and self.hands_out_params else None
            usage = {"usage": self._usage()} if self.cached_tokens is not None and not prefill else {}
            return JSONResponse({"id": answer_id, "choices": [{"text": text}], "kv_transfer_params": handed} | usage)

        async def stored(response_id: str):
            found = response_id in self.stored
            return JSONResponse({"id": response_id, "by": self.name} if found else {"error": {"code": 404}},
                                status_code=200 if found else 404)

        async def detokenize(request: Request):
            self.bodies.append(await request.json())
            self.headers.append(dict(request.headers))
            return JSONResponse({"prompt": f"by {self.name}"})

        async def load(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            name = body["lora_name"]
            if name in self.adapters:
                return _error(400, f"The lora adapter '{name}' has already been loaded.")
            if body["lora_path"] in self.missing:
                return _error(404, f"Loading lora {name} failed: No adapter found for {body['lora_path']}")
            self.adapters.add(name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        async def unload(request: Request):
            name = (await request.json())["lora_name"]
            if name not in self.adapters:
                return _error(404, f"The lora adapter '{name}' cannot be found.")
            self.adapters.discard(name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        app.add_api_route("/v1/load_lora_adapter", load, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"])
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
            app.add_api_route(path, generate, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", stored, methods=["GET"])
        app.add_api_route("/detokenize", detokenize, methods=["POST"])
        return app

    def _usage(self) -> dict[str, Any]:
        return {"prompt_tokens": 1, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _answer_id(self, request: Request, prefill: bool, body: dict[str, Any]) -> str | None:
        """A Responses answer's id (kept in `stored` unless the body said `store: false`); None for other APIs."""
        if request.url.path != "/v1/responses":
            return None
        answer_id = f"resp_{self.name}_{len(self.bodies)}"
        if body.get("store", True) and not prefill:
            self.stored.add(answer_id)
        return answer_id


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}}, status_code=status)


def router_over(prefill: list[FakeVLLM], decode: list[FakeVLLM], **config) -> TestClient:
    """The vLLM-mode router in front of `prefill` and `decode` (enter it to serve), with a short health interval."""
    made = VLLMRouterConfig(prefill_urls=tuple(f.url for f in prefill), decode_urls=tuple(f.url for f in decode),
                            health_interval_s=HEALTH_S, connect_timeout_s=CONNECT_S, **config)
    return TestClient(create_vllm_app(made, Metrics()))
