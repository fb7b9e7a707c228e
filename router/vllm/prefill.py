"""The prefill step of a request the router disaggregates, and what it learns of each prefill instance.

1. The router picks the least loaded prefill instance up (router/vllm/pool.py).
2. `run(...)`: that instance computes the prompt (max_tokens 1, its KV kept for a decode instance,
   under the directory key the router chose if it chose one). What it answers becomes `Prefilled`:
   the kv_transfer_params for the decode instance, or why there are none (the request then goes
   decode-only), or its 4xx for the client.
3. Each answer with KvwireConnector's params tells the instance's `Producer` (its tensor-parallel
   size): from then on `producer(url)` lets the router tell a decode instance where to wait for the
   KV before the prefill instance has answered (connectors/vllm/params.py, "announced ahead").
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import httpx2

from kvwire.observability.labels import PathReason, ProxyPath
from kvwire.observability.metrics import Metrics
from kvwire.router.vllm import upstream as upstream
from kvwire.router.vllm.bodies import Endpoint, Producer, kv_transfer_params_of, prefill_body, producer_of
from kvwire.router.vllm.pool import InstancePool, Problem
from kvwire.router.vllm.upstream import FailureKind, InstanceError

log = logging.getLogger(__name__)

PATH_HEADER = "x-kvwire-path"
REASON_HEADER = "x-kvwire-reason"
DECODE_HEADER = "x-kvwire-decode"
PREFILL_HEADER = "x-kvwire-prefill"


class Prefilled(NamedTuple):
    """What the prefill step left: the kv_transfer_params for the decode instance (None: decode-only) and why,
    the prefill instance asked, or a prefill instance's 4xx to give the client instead."""

    kv_transfer_params: dict[str, Any] | None
    reason: PathReason
    prefill: str | None = None
    refusal: httpx2.Response | None = None

    @property
    def path(self) -> ProxyPath:
        return ProxyPath.DECODE_ONLY if self.kv_transfer_params is None else ProxyPath.DISAGGREGATED

    def headers(self, decode: str) -> dict[str, str]:
        """The x-kvwire-* headers of an answer `decode` gave."""
        out = {PATH_HEADER: str(self.path), REASON_HEADER: str(self.reason), DECODE_HEADER: decode}
        return out | ({PREFILL_HEADER: self.prefill} if self.prefill and self.kv_transfer_params is not None else {})


def record_failure(metrics: Metrics, pool: InstancePool, url: str, exc: InstanceError) -> None:
    """A failed call to `url`: counted by role and kind, and weighed by `pool`."""
    metrics.vllm_instance_failures.labels(str(pool.role), str(exc.kind)).inc()
    pool.observe(url, Problem(exc.kind, exc.reason))


class PrefillStep:
    """The prefill instances, and the producers their answers showed."""

    def __init__(self, pool: InstancePool, metrics: Metrics):
        self.pool = pool
        self._metrics = metrics
        self._producers: dict[str, Producer] = {}  # prefill URL -> what its last answer's params showed
        self._without_params: set[str] = set()  # prefill instances that answered no kv_transfer_params

    def producer(self, url: str) -> Producer | None:
        """What `url`'s last answer showed of its KvwireConnector; None before one, or for another connector."""
        return self._producers.get(url)

    async def run(self, client: httpx2.AsyncClient, rid: str, url: str, endpoint: Endpoint, body: dict[str, Any],
                  headers: dict[str, str], key: str | None = None) -> Prefilled:
        """`url` computes the prompt of the client's `body`, its KV held under `key` (None: its request id)."""
        self.pool.started(url)
        try:
            resp = await upstream.post(client, rid, url, endpoint, prefill_body(body, endpoint, key), headers)
        except InstanceError as exc:
            record_failure(self._metrics, self.pool, url, exc)
            log.warning("%s; request %s goes on decode-only", exc, rid)
            return Prefilled(None, PathReason.PREFILL_FAILED, url)
        finally:
            self.pool.ended(url)
        if upstream.is_instance_fault(resp.status_code):
            record_failure(self._metrics, self.pool, url,
                           InstanceError(rid, url, FailureKind.BROKEN, f"answered {resp.status_code}"))
            log.warning("request %s: prefill instance %s answered %d; decode-only", rid, url, resp.status_code)
            return Prefilled(None, PathReason.PREFILL_FAILED, url)
        self.pool.observe(url, None)
        if resp.status_code != 200:
            return Prefilled(None, PathReason.PREFILL_FAILED, url, refusal=resp)
        params = kv_transfer_params_of(resp.content)
        if params is None:
            # a vLLM with no KV connector answers null every time: say so once per instance
            level = logging.DEBUG if url in self._without_params else logging.WARNING
            self._without_params.add(url)
            log.log(level, "request %s: prefill instance %s answered no kv_transfer_params (started without "
                    "--kv-transfer-config?); decode-only", rid, url)
            self._producers.pop(url, None)
            return Prefilled(None, PathReason.NO_KV_PARAMS, url)
        producer = producer_of(params)
        if producer is None:
            self._producers.pop(url, None)
        else:
            self._producers[url] = producer
        return Prefilled(params, PathReason.PREFILLED, url)
