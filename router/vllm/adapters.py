"""LoRA adapters loaded at run time (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) through the router.

POST /v1/load_lora_adapter and /v1/unload_lora_adapter go to every instance up, prefill and decode: a disaggregated
request for an adapter needs it on the prefill instance that computes its prompt and on the decode instance that
goes on from its KV. Lifecycle of one adapter:
1. LOAD: each instance up is asked at once. Every instance reached took it (or had it already, while another
   took it): the client gets the first one's answer (vLLM's text), and the load is kept (its body, by adapter
   name). One that refused: the client gets its status and an error naming each instance's answer; nothing is
   undone (what the others did stands, as that error says; the same load again then completes it), and the load is
   not kept.
2. BACK: an instance that comes back into rotation (a restarted vLLM has forgotten its runtime adapters), or was
   down or unreached at the load, is given every kept load (`give`, from the health checks); an instance that
   still has it answers 400 "already loaded", which is fine.
3. UNLOAD: likewise to every instance up; an adapter unloaded so is forgotten.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

import httpx2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvwire.observability.labels import InstanceState
from kvwire.observability.metrics import Metrics
from kvwire.router.schemas import APIError
from kvwire.router.vllm import http as http
from kvwire.router.vllm.pool import InstancePool
from kvwire.router.vllm.prefill import record_failure
from kvwire.router.vllm.upstream import InstanceError, call_whole

log = logging.getLogger(__name__)
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class Reply(NamedTuple):
    url: str
    answer: httpx2.Response | InstanceError


class Adapters:
    """The two routes (module docstring) over `pools`, and the loads kept for instances that come back."""

    def __init__(self, client: Callable[[], httpx2.AsyncClient], pools: Sequence[InstancePool], metrics: Metrics):
        self._client = client
        self._pools = pools
        self._metrics = metrics
        # adapter name -> the body of the load its instances took, and its headers (the client's credentials: a
        # server started with --api-key asks for them)
        self._loaded: dict[str, tuple[bytes, dict[str, str]]] = {}

    async def load(self, request: Request) -> Response:
        return await self._everywhere(request, LOAD)

    async def unload(self, request: Request) -> Response:
        return await self._everywhere(request, UNLOAD)

    async def give(self, pool: InstancePool, urls: Sequence[str]) -> None:
        """Instances `urls` of `pool` came back into rotation: each is given every adapter loaded through here."""
        for name, (body, headers) in list(self._loaded.items()):
            rid = f"kvw-lora-{uuid.uuid4().hex}"
            for url, answer in await self._send([(pool, url) for url in urls], LOAD, body,
                                                   headers | {"x-request-id": rid}, rid):
                if isinstance(answer, InstanceError) or answer.status_code >= 400 and not _already(answer):
                    log.warning("LoRA adapter %s not loaded again on %s, back in rotation: %s", name, url,
                                _said(answer))
                else:
                    log.info("LoRA adapter %s loaded on %s, back in rotation", name, url)

    async def _everywhere(self, request: Request, path: str) -> Response:
        rid, body = http.request_id(request), await request.body()
        name = _name(body)
        targets = list({url: (pool, url) for pool in self._pools  # a kv_both server in both roles: once
                        for url in pool.urls(InstanceState.UP)}.values())
        if not targets:
            raise APIError(503, f"request {rid}: no vLLM instance is up", type_="service_unavailable")
        headers = http.upstream_headers(request, rid) | {
            "content-type": request.headers.get("content-type", "application/json")}
        replies = await self._send(targets, path, body, headers, rid)
        answers = [r.answer for r in replies if isinstance(r.answer, httpx2.Response)]
        done = [a for a in answers if a.status_code < 400]
        refused = [a for a in answers if a.status_code >= 400 and not (done and _moot(a, path))]
        if refused or not done:
            status = refused[0].status_code if refused else answers[0].status_code if answers else 502
            message = f"{path} of {name!r}: " + "; ".join(f"{r.url} {_said(r.answer)}" for r in replies)
            return JSONResponse(APIError(status, message).body(), status_code=status, headers={"x-request-id": rid})
        if path == LOAD:
            self._loaded[name] = (body, {k: v for k, v in headers.items() if k in ("authorization", "content-type")})
        else:
            self._loaded.pop(name, None)
        for r in replies:
            if isinstance(r.answer, InstanceError):
                log.warning("request %s: %s of %r did not reach %s (%s)%s", rid, path, name, r.url, r.answer.reason,
                            "; it is given the adapter when back in rotation" if path == LOAD else "")
        return http.whole(done[0], rid, {})

    async def _send(self, targets: Sequence[tuple[InstancePool, str]], path: str, body: bytes,
                    headers: dict[str, str], rid: str) -> list[Reply]:
        async def one(pool: InstancePool, url: str) -> Reply:
            try:
                answer = await call_whole(self._client(), rid, url, "POST", path, body, headers)
            except InstanceError as exc:
                record_failure(self._metrics, pool, url, exc)  # a refused one is out, and given the load when back
                return Reply(url, exc)
            pool.observe(url, None)
            return Reply(url, answer)

        return list(await asyncio.gather(*(one(pool, url) for pool, url in targets)))


def _name(body: bytes) -> str:
    try:
        name = json.loads(body).get("lora_name")
    except (ValueError, AttributeError):
        name = None
    return name if isinstance(name, str) else ""


def _already(answer: httpx2.Response) -> bool:
    """Whether vLLM refused a load because the instance has that adapter already."""
    return answer.status_code == 400 and "already been loaded" in answer.text


def _moot(answer: httpx2.Response, path: str) -> bool:
    """Whether an instance's refusal leaves it as the call meant (loaded already; unloaded already): with another
    instance doing it, the call succeeds (a load retried after one instance refused it succeeds)."""
    if path == LOAD:
        return _already(answer)
    return answer.status_code == 404 and "cannot be found" in answer.text


def _said(answer: httpx2.Response | InstanceError) -> str:
    if isinstance(answer, InstanceError):
        return f"was not reached ({answer.kind}: {answer.reason})"
    return f"answered {answer.status_code}: {answer.text[:300]}"
