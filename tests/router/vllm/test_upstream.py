"""A call to a vLLM instance that dies under it is an InstanceError, whatever the HTTP stack raises."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from kvwire.router.vllm import upstream as upstream
from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.pool import HealthProbe


def _raising(exc: Exception) -> httpx2.AsyncClient:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise exc
    return httpx2.AsyncClient(transport=httpx2.MockTransport(handler))


# what httpcore over anyio raised when the prefill server was SIGKILLed while the router connected to it
DYING = [AttributeError("'NoneType' object has no attribute 'getpeername'"), ConnectionResetError(104, "reset"),
         httpx2.ReadError("read")]


@pytest.mark.parametrize("exc", DYING, ids=lambda e: type(e).__name__)
def test_a_peer_dying_mid_call_is_an_instance_error(exc):
    async def call() -> None:
        async with _raising(exc) as client:
            with pytest.raises(upstream.InstanceError, match="req-1"):
                await upstream.post(client, "req-1", "http://p", Endpoint.COMPLETIONS, {"prompt": "x"}, {})
            with pytest.raises(upstream.InstanceError):
                await upstream.open_stream(client, "req-1", "http://p", Endpoint.COMPLETIONS, {}, {})
            assert await HealthProbe(client, httpx2.Timeout(1.0))("http://p")  # down, with a reason
    asyncio.run(call())
