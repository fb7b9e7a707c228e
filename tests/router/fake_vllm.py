"""A stand-in for a vLLM server's HTTP API, for the router's unit tests: real sockets, scripted behaviour.

`FakeVLLM(port)` serves in a thread once `start()`ed, until `stop()` (and may start again on the same port):
GET /health (after `health_delay_s`), GET /v1/models, and POST /v1/completions and /v1/chat/completions,
which answer after `answer_delay_s` (or not at all, once their client has gone away):
- a prefill's body (`do_remote_decode`) as KvwireConnector's producer would: `kv_transfer_params` naming
  `name` and the `kvwire_key` it was given (none while `hands_out_params` is off; the HTTP status
  `prefill_status` instead of 200 when set);
- a decode's, `kv_wait_s` later if told of a remote prefill (waiting for its KV; given up, as vLLM aborts,
  when the client goes away: counted in `aborted`), with the `kv_transfer_params` it got echoed in its text;
  streams as two SSE chunks.
`bodies` records what each POST carried, `headers` its headers. GET /metrics answers `metrics` (404 while it is
"").
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
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeVLLM:
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
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

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
            if body.get("stream") and not prefill:
                chunks = [f"data: {json.dumps({'choices': [{'text': t}]})}\n\n" for t in (self.name, " done")]
                return StreamingResponse(iter([*chunks, "data: [DONE]\n\n"]), media_type="text/event-stream")
            handed = handed if prefill and self.hands_out_params else None
            return JSONResponse({"choices": [{"text": text}], "kv_transfer_params": handed})

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
        return app
