"""InstancePool: round robin over the instances up, taken out on failure, re-admitted by health checks."""

from __future__ import annotations

import asyncio

import httpx

from kvwire.connectors.config import NodeRole
from kvwire.observability.labels import InstanceState
from kvwire.router.vllm_pool import HealthProbe, InstancePool

A, B, C = "http://a:1", "http://b:1", "http://c:1"


class ScriptedProbe:
    """Answers each URL's health from a set the test changes; records what it was asked."""

    def __init__(self, serving: set[str]):
        self.serving = serving
        self.asked: list[str] = []

    async def __call__(self, url: str) -> str | None:
        self.asked.append(url)
        return None if url in self.serving else "connection refused"


def test_pick_rotates_over_every_instance_in_order():
    pool = InstancePool(NodeRole.DECODE, [A, B, C])
    assert [pool.pick() for _ in range(7)] == [A, B, C, A, B, C, A]


def test_taken_out_instance_is_skipped_until_readmitted():
    pool = InstancePool(NodeRole.PREFILL, [A, B, C])
    pool.take_out(B, "connect refused")
    assert {pool.pick() for _ in range(6)} == {A, C}
    assert pool.urls(InstanceState.DOWN) == [B] and pool.count(InstanceState.UP) == 2
    pool.readmit(B)
    assert {pool.pick() for _ in range(3)} == {A, B, C}


def test_pick_is_none_when_every_instance_is_down():
    pool = InstancePool(NodeRole.DECODE, [A, B])
    pool.take_out(A, "x")
    pool.take_out(B, "y")
    assert pool.pick() is None
    assert InstancePool(NodeRole.PREFILL, []).pick() is None


def test_describe_tells_why_and_how_long_an_instance_is_down():
    now = [100.0]
    pool = InstancePool(NodeRole.DECODE, [A, B], clock=lambda: now[0])
    pool.take_out(A, "answered 500")
    now[0] = 103.25
    pool.take_out(A, "answered 502")  # still down: the reason changes, not since when
    assert pool.describe() == {"up": [B], "down": [{"url": A, "reason": "answered 502", "down_s": 3.2}]}


def test_check_takes_out_the_silent_and_readmits_those_that_answer():
    pool = InstancePool(NodeRole.DECODE, [A, B, C])
    probe = ScriptedProbe(serving={A, C})
    asyncio.run(pool.check(probe))
    assert sorted(probe.asked) == [A, B, C]
    assert pool.urls(InstanceState.UP) == [A, C]
    assert pool.describe()["down"] == [{"url": B, "reason": "health check: connection refused", "down_s": 0.0}]
    probe.serving = {B}
    asyncio.run(pool.check(probe))
    assert pool.urls(InstanceState.UP) == [B] and pool.urls(InstanceState.DOWN) == [A, C]


def test_health_probe_reports_an_instance_nobody_listens_on():
    async def probe_once() -> str | None:
        async with httpx.AsyncClient() as client:
            return await HealthProbe(client, httpx.Timeout(2.0))("http://127.0.0.1:1")

    problem = asyncio.run(probe_once())
    assert problem is not None and "ConnectError" in problem
