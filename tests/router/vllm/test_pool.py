"""InstancePool: the least loaded instance up, taken out on evidence that it is gone, re-admitted by health checks."""

from __future__ import annotations

import asyncio

import httpx2

from kvwire.connectors.config import NodeRole
from kvwire.observability.labels import InstanceState
from kvwire.router.vllm.load import ServerLoad
from kvwire.router.vllm.pool import HealthProbe, InstancePool, Problem, Tolerance
from kvwire.router.vllm.upstream import FailureKind

A, B, C = "http://a:1", "http://b:1", "http://c:1"
REFUSED = Problem(FailureKind.REFUSED, "connection refused")
SLOW = Problem(FailureKind.TIMEOUT, "ReadTimeout")
BROKEN = Problem(FailureKind.BROKEN, "answered 500")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedProbe:
    """Answers each URL's health from a dict the test changes (absent: serving); records what it was asked."""

    def __init__(self, problems: dict[str, Problem]):
        self.problems = problems
        self.asked: list[str] = []

    async def __call__(self, url: str) -> Problem | None:
        self.asked.append(url)
        return self.problems.get(url)


def test_pick_rotates_over_instances_equally_loaded():
    pool = InstancePool(NodeRole.DECODE, [A, B, C])
    assert [pool.pick() for _ in range(7)] == [A, B, C, A, B, C, A]


def test_pick_prefers_the_instance_with_fewest_requests_in_flight():
    pool = InstancePool(NodeRole.DECODE, [A, B])
    pool.started(A)
    pool.started(A)
    pool.started(B)
    assert {pool.pick() for _ in range(4)} == {B}
    pool.ended(A)
    pool.ended(A)
    assert {pool.pick() for _ in range(4)} == {A}
    assert pool.in_flight(A) == 0 and pool.in_flight(B) == 1


def test_pick_avoids_instances_already_tried_unless_only_they_are_up():
    pool = InstancePool(NodeRole.DECODE, [A, B])
    assert {pool.pick(avoid=frozenset({A})) for _ in range(4)} == {B}
    pool.take_out(B, "gone")
    assert pool.pick(avoid=frozenset({A})) == A


def test_a_refused_connection_takes_an_instance_out_at_once():
    pool = InstancePool(NodeRole.PREFILL, [A, B, C])
    pool.observe(B, REFUSED)
    assert {pool.pick() for _ in range(6)} == {A, C}
    assert pool.urls(InstanceState.DOWN) == [B] and pool.count(InstanceState.UP) == 2
    pool.readmit(B)
    assert {pool.pick() for _ in range(3)} == {A, B, C}


def test_a_slow_instance_is_weighed_as_loaded_not_taken_out():
    clock = Clock()
    pool = InstancePool(NodeRole.DECODE, [A, B], clock=clock, tolerance=Tolerance(unresponsive_s=30.0))
    for _ in range(10):
        clock.now += 2.0  # 20 s of timeouts: under unresponsive_s
        pool.observe(A, SLOW)
        pool.observe(A, Problem(FailureKind.BUSY, "ConnectTimeout"))
    assert pool.count(InstanceState.UP) == 2 and pool.describe()["slow"] == [A]
    pool.started(B)
    assert {pool.pick() for _ in range(4)} == {B}, "slow counts as more load than one request in flight"
    pool.observe(A, None)  # it answered: no longer slow
    assert pool.describe()["slow"] == [] and {pool.pick() for _ in range(4)} == {A}


def test_an_instance_that_answers_nothing_for_unresponsive_s_leaves():
    clock = Clock()
    pool = InstancePool(NodeRole.DECODE, [A], clock=clock, tolerance=Tolerance(unresponsive_s=30.0))
    pool.observe(A, None)
    clock.now += 29.0
    pool.observe(A, SLOW)
    assert pool.count(InstanceState.UP) == 1
    clock.now += 1.0
    pool.observe(A, SLOW)
    assert pool.pick() is None and "nothing answered for 30 s" in pool.describe()["down"][0]["reason"]


def test_failures_take_an_instance_out_only_when_they_run_max_failures_in_a_row():
    pool = InstancePool(NodeRole.DECODE, [A], tolerance=Tolerance(max_failures=3))
    pool.observe(A, BROKEN)
    pool.observe(A, BROKEN)
    pool.observe(A, None)  # an answer between them starts the count again
    pool.observe(A, BROKEN)
    pool.observe(A, BROKEN)
    assert pool.count(InstanceState.UP) == 1
    pool.observe(A, BROKEN)
    assert pool.describe()["down"][0]["reason"] == "3 failures in a row; last: answered 500"


def test_pick_is_none_when_every_instance_is_down():
    pool = InstancePool(NodeRole.DECODE, [A, B])
    pool.take_out(A, "x")
    pool.take_out(B, "y")
    assert pool.pick() is None
    assert InstancePool(NodeRole.PREFILL, []).pick() is None


def test_describe_tells_why_and_how_long_an_instance_is_down():
    clock = Clock()
    pool = InstancePool(NodeRole.DECODE, [A, B], clock=clock)
    pool.take_out(A, "answered 500")
    clock.now += 3.25
    pool.take_out(A, "answered 502")  # still down: the reason changes, not since when
    pool.measured(B, ServerLoad(0, 0.0, 16))
    assert pool.describe() == {"up": [B], "block_sizes": {B: 16}, "slow": [],
                               "down": [{"url": A, "reason": "answered 502", "down_s": 3.2}]}


def test_check_takes_out_the_gone_keeps_the_slow_and_readmits_those_that_answer():
    pool = InstancePool(NodeRole.DECODE, [A, B, C])
    probe = ScriptedProbe({B: REFUSED, C: SLOW})
    asyncio.run(pool.check(probe))
    assert sorted(probe.asked) == [A, B, C]
    assert pool.urls(InstanceState.UP) == [A, C] and pool.describe()["slow"] == [C]
    assert pool.describe()["down"] == [{"url": B, "reason": "health check: connection refused", "down_s": 0.0}]
    probe.problems = {A: REFUSED, C: REFUSED}
    asyncio.run(pool.check(probe))
    assert pool.urls(InstanceState.UP) == [B] and pool.urls(InstanceState.DOWN) == [A, C]


def test_health_probe_reports_an_instance_nobody_listens_on_as_refused():
    async def probe_once() -> Problem | None:
        async with httpx2.AsyncClient() as client:
            return await HealthProbe(client, httpx2.Timeout(2.0))("http://127.0.0.1:1")

    problem = asyncio.run(probe_once())
    assert problem is not None and problem.kind == FailureKind.REFUSED and "ConnectError" in problem.reason


def test_wait_up_returns_when_an_instance_is_readmitted_and_false_at_its_timeout():
    pool = InstancePool(NodeRole.DECODE, [A])
    pool.take_out(A, "gone")

    async def readmitted_later() -> tuple[bool, bool]:
        asyncio.get_running_loop().call_later(0.05, pool.readmit, A)
        came = await asyncio.wait_for(pool.wait_up(10.0), 5.0)  # woken by the readmission, not the timeout
        pool.take_out(A, "gone again")
        return came, await pool.wait_up(0.05)

    assert asyncio.run(readmitted_later()) == (True, False)


def test_a_requests_choices_go_to_the_least_busy_data_parallel_engine():

    pool = InstancePool(NodeRole.DECODE, [A, B])
    assert pool.engine_for(A) is None  # its metrics not read yet
    pool.measured(A, ServerLoad(0, 0.0, 16, engines=(3, 1, 1)))
    pool.measured(B, ServerLoad(0, 0.0, 16))  # one engine
    assert pool.engine_for(B) is None
    assert sorted(pool.engine_for(A) for _ in range(4)) == [1, 1, 2, 2]  # the two least busy, in turn
