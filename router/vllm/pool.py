"""The vLLM instances of one role that the router sends requests to, weighed by load, in rotation or out of it.

Lifecycle of an instance:

1. UP from the start: `pick()` hands out the UP instance of the least cost: its load (`load`: the KV blocks of
   the requests in flight through this router, `started` .. `ended`; plus, at a request's blocks each, the
   requests its own GET /metrics last said were queued there beyond this router's own (those in flight there
   when the metrics were asked or answered), SLOW_WEIGHT if it answered slowly and FULL_WEIGHT if its KV cache
   was FULL or more in use) and, when the caller gives one, a cost of its own per instance
   (the router's: the prompt blocks it would compute, router/vllm/schedule.py); ties in turn (round robin).
2. What each call or health probe says of it (`observe`):
   - an answer (any HTTP status below 500): it serves; its failures and slowness are forgotten;
   - REFUSED (nobody accepts connections there): it is gone, DOWN at once;
   - BUSY or TIMEOUT (a connection or an answer not made in time): slow, weighed as loaded; it
     goes DOWN only once nothing it did succeeded for `unresponsive_s` (a hung process);
   - BROKEN or a 5xx: a failure; DOWN after `max_failures` in a row.
3. DOWN: `pick()` skips it; a later probe of GET /health that answers 200 puts it back UP
   (`check`, run every `health_interval_s` by `run_health_checks`).

A pool lives on one event loop and is not shared between threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import httpx2

from kvwire.connectors.config import NodeRole
from kvwire.connectors.wire import kv_quant_of
from kvwire.observability.labels import InstanceState
from kvwire.router.vllm.load import ServerLoad
from kvwire.router.vllm.upstream import PEER_ERRORS, FailureKind, failure_kind

log = logging.getLogger(__name__)

SLOW_WEIGHT = 4  # requests in flight an instance that last answered slowly counts as, on top of its own
FULL = 0.9  # the share of its KV cache in use from which an instance counts as FULL_WEIGHT requests more
FULL_WEIGHT = 4


class Problem(NamedTuple):
    """What went wrong with one call to an instance: how, and the transport's (or HTTP's) words."""

    kind: FailureKind
    reason: str


class Probe(Protocol):
    """Asks one instance whether it serves."""

    async def __call__(self, url: str) -> Problem | None:
        """Args: url, an instance's base URL. Returns: None when it serves, else what went wrong."""
        ...


class Scrape(Protocol):
    """Reads one instance's load from its metrics."""

    async def __call__(self, url: str) -> ServerLoad | None:
        """Returns: what its metrics show; None when they could not be read."""
        ...


@dataclass(frozen=True)
class Tolerance:
    """How much failure an instance is allowed before it leaves rotation (module docstring, step 2)."""

    max_failures: int = 3
    unresponsive_s: float = 30.0


@dataclass
class Instance:
    """One vLLM instance: its base URL, whether it is in rotation (since when, why not), and its load."""

    url: str
    state: InstanceState = InstanceState.UP
    since: float = 0.0
    reason: str = ""
    in_flight: int = 0  # requests of this router it is working on
    blocks: int = 0  # their KV blocks (prompt blocks; 1 for a request whose prompt the router did not read)
    queued: int = 0  # requests of other clients waiting there, at its last GET /metrics
    full: bool = False  # its KV cache was FULL or more in use, at its last GET /metrics
    failures: int = 0  # BROKEN or 5xx in a row
    slow: bool = False  # its last call timed out
    last_ok: float = 0.0  # when it last answered
    engines: tuple[int, ...] = ()  # each data-parallel engine's requests at its last GET /metrics (() for one)
    engine_turn: int = 0  # rotates ties between its engines
    block_size: int = 0  # tokens per KV block, as its GET /metrics last showed (0: not yet)
    kv_quant: str | None = None  # its KV cache's quantization (KVLayout.kv_quant, "": none), once its metrics showed


class InstancePool:
    """The instances of one role; `pick()` hands out the least loaded of those UP."""

    def __init__(self, role: NodeRole, urls: Sequence[str], clock: Callable[[], float] = time.monotonic,
                 tolerance: Tolerance = Tolerance()):
        self.role = role
        self._clock = clock
        self._tolerance = tolerance
        self._instances = {url: Instance(url, since=clock(), last_ok=clock()) for url in urls}
        self._turn = 0
        self._readmitted = asyncio.Event()  # set when an instance comes back (wait_up)
        self._block_size = 0

    def pick(self, avoid: frozenset[str] = frozenset(), cost: Callable[[str], float] | None = None,
             request_blocks: int = 1, block_size: int = 0, kv_quant: str | None = None) -> str | None:
        """Returns: the URL of the UP instance (not in `avoid`, unless only those are UP) of the least `cost(url)`
        + load, ties in round-robin order; None when none is UP. `request_blocks`: a request's KV blocks, what
        each request queued on an instance (or SLOW_WEIGHT of them) weighs. `block_size`: only instances whose KV
        blocks pair with blocks of that size (`pairs`), or not yet known (0: any); `kv_quant`: only instances of
        that KV cache quantization, or not yet known (None: any)."""
        up = [i for i in self._instances.values() if i.state == InstanceState.UP and pairs(i.block_size, block_size)
              and (kv_quant is None or i.kv_quant is None or i.kv_quant == kv_quant)]
        up = [i for i in up if i.url not in avoid] or up
        if not up:
            return None
        self._turn += 1
        start = (self._turn - 1) % len(up)
        rotated = up[start:] + up[:start]
        return min(rotated, key=lambda i: (cost(i.url) if cost else 0) + self.load(i.url, request_blocks)).url

    def load(self, url: str, request_blocks: int = 1) -> float:
        """`url`'s load in KV blocks (module docstring, step 1)."""
        instance = self._instances[url]
        queued = instance.queued + (SLOW_WEIGHT if instance.slow else 0) + (FULL_WEIGHT if instance.full else 0)
        return instance.blocks + queued * request_blocks

    def started(self, url: str, blocks: int = 1) -> None:
        """A request of this router (of `blocks` KV blocks) went to `url`: it counts in its load until `ended`."""
        self._instances[url].in_flight += 1
        self._instances[url].blocks += blocks

    def ended(self, url: str, blocks: int = 1) -> None:
        """A request `started` on `url` has its whole answer (or failed)."""
        self._instances[url].in_flight -= 1
        self._instances[url].blocks -= blocks

    def measured(self, url: str, server: ServerLoad, in_flight_then: int = 0) -> None:
        """What `url`'s GET /metrics showed, asked while this router had `in_flight_then` requests there."""
        instance = self._instances[url]
        ours = max(in_flight_then, instance.in_flight)  # queued there, for all the router knows
        instance.queued, instance.full = max(0, server.waiting - ours), server.kv_usage >= FULL
        instance.engines = server.engines
        if server.cache_dtype:
            instance.kv_quant = kv_quant_of(server.cache_dtype)
        if server.block_size:
            instance.block_size = server.block_size
            self._block_size = min(self._block_size or server.block_size, server.block_size)

    def block_size_of(self, url: str) -> int:
        """`url`'s KV block size, as its GET /metrics last showed; 0 before it did."""
        return self._instances[url].block_size

    def kv_quant_of(self, url: str) -> str | None:
        """`url`'s KV cache quantization ("": none), as its GET /metrics last showed; None before it did."""
        return self._instances[url].kv_quant

    def block_sizes(self) -> dict[str, int]:
        """Each UP instance's KV block size, where its GET /metrics showed one."""
        return {i.url: i.block_size for i in self._instances.values() if i.state == InstanceState.UP and i.block_size}

    def engine_for(self, url: str) -> int | None:
        """The data-parallel engine of `url` to send all of one request's choices to (vLLM spreads a request's
        n > 1 choices over its engines otherwise, and each engine would pull the one KV): the least busy at its
        last GET /metrics, ties in turn. None for a server of one engine (or whose metrics did not say)."""
        instance = self._instances[url]
        count = len(instance.engines)
        if count < 2:
            return None
        least = [k for k in range(count) if instance.engines[k] == min(instance.engines)]
        instance.engine_turn += 1
        return least[instance.engine_turn % len(least)]

    def block_size(self) -> int:
        """The KV block size the instances' metrics showed (the smallest, if they differ); 0 before any did."""
        return self._block_size

    def in_flight(self, url: str) -> int:
        return self._instances[url].in_flight

    def urls(self, state: InstanceState) -> list[str]:
        """Returns: the URLs of the instances in `state`, in the order they were configured."""
        return [i.url for i in self._instances.values() if i.state == state]

    def count(self, state: InstanceState) -> int:
        return sum(1 for i in self._instances.values() if i.state == state)

    def observe(self, url: str, problem: Problem | None) -> None:
        """What one call to (or probe of) `url` showed: None, that it answered. Raises: KeyError, not an instance."""
        instance, now = self._instances[url], self._clock()
        if problem is None:
            instance.failures, instance.slow, instance.last_ok = 0, False, now
            return
        if problem.kind == FailureKind.REFUSED:
            self.take_out(url, problem.reason)
        elif problem.kind in (FailureKind.BUSY, FailureKind.TIMEOUT):
            instance.slow = True
            if now - instance.last_ok >= self._tolerance.unresponsive_s:
                self.take_out(url, f"nothing answered for {now - instance.last_ok:.0f} s; last: {problem.reason}")
        else:
            instance.failures += 1
            if instance.failures >= self._tolerance.max_failures:
                self.take_out(url, f"{instance.failures} failures in a row; last: {problem.reason}")

    def take_out(self, url: str, reason: str) -> None:
        """Take `url` out of rotation until a health probe re-admits it. Raises: KeyError, as `observe`."""
        instance = self._instances[url]
        if instance.state == InstanceState.UP:
            log.warning("vLLM %s instance %s out of rotation: %s", self.role, url, reason)
            instance.state, instance.since = InstanceState.DOWN, self._clock()
        instance.reason = reason

    def readmit(self, url: str) -> bool:
        """Put `url` back in rotation. Returns: whether it was out. Raises: KeyError, as `observe`."""
        instance = self._instances[url]
        back = instance.state == InstanceState.DOWN
        if back:
            log.info("vLLM %s instance %s back in rotation", self.role, url)
            instance.state, instance.since, instance.reason = InstanceState.UP, self._clock(), ""
            self._readmitted.set()
        self.observe(url, None)  # it answers: failures and slowness forgotten
        return back

    async def wait_up(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for an instance to be UP (a health check re-admits it). Returns: whether one is."""
        deadline = time.monotonic() + timeout_s
        while not self.count(InstanceState.UP):
            self._readmitted.clear()
            try:
                await asyncio.wait_for(self._readmitted.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return bool(self.count(InstanceState.UP))
        return True

    async def check(self, probe: Probe, scrape: Scrape | None = None) -> list[str]:
        """Probe every instance at once: re-admit those that serve, observe what the others showed; then `scrape`
        the load of those that serve. Returns: the instances that came back into rotation."""
        urls = list(self._instances)
        serving, back = [], []
        for url, problem in zip(urls, await asyncio.gather(*(probe(url) for url in urls))):
            if problem is None:
                if self.readmit(url):
                    back.append(url)
                serving.append(url)
            else:
                self.observe(url, Problem(problem.kind, f"health check: {problem.reason}"))
        if scrape is not None:
            then = [self._instances[url].in_flight for url in serving]
            for url, server, in_flight in zip(serving, await asyncio.gather(*(scrape(url) for url in serving)), then):
                if server is not None:
                    self.measured(url, server, in_flight)
        return back

    def describe(self) -> dict[str, object]:
        """Returns: the instances UP (and those of them slow) and those DOWN with why, for /healthz."""
        now = self._clock()
        return {"up": self.urls(InstanceState.UP), "block_sizes": self.block_sizes(),
                "slow": [i.url for i in self._instances.values() if i.state == InstanceState.UP and i.slow],
                "down": [{"url": i.url, "reason": i.reason, "down_s": round(now - i.since, 1)}
                         for i in self._instances.values() if i.state == InstanceState.DOWN]}


def pairs(a: int, b: int) -> bool:
    """Whether KV moves between pools of blocks of `a` and `b` tokens (0: not known, taken to): one divides the
    other (a pull moves it in blocks of the smaller: connectors/transports/sub_blocks.py)."""
    return not a or not b or max(a, b) % min(a, b) == 0


class HealthProbe:
    """GET {url}/health, which vLLM answers 200 once its engine serves."""

    def __init__(self, client: httpx2.AsyncClient, timeout: httpx2.Timeout):
        self._client = client
        self._timeout = timeout

    async def __call__(self, url: str) -> Problem | None:
        try:
            resp = await self._client.get(f"{url}/health", timeout=self._timeout)
        except PEER_ERRORS as exc:
            return Problem(failure_kind(exc), f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if resp.status_code == 200:
            return None
        return Problem(FailureKind.BROKEN, f"GET /health answered {resp.status_code}")


class Back(Protocol):
    async def __call__(self, pool: InstancePool, urls: Sequence[str]) -> None:
        """Instances `urls` of `pool` came back into rotation."""


async def run_health_checks(pools: Sequence[InstancePool], probe: Probe, interval_s: float,
                            scrape: Scrape | None = None, back: Back | None = None) -> None:
    """Check every pool every `interval_s` seconds, until cancelled; `back` is told who came back after each."""
    while True:
        await asyncio.sleep(interval_s)
        for pool, urls in zip(pools, await asyncio.gather(*(pool.check(probe, scrape) for pool in pools))):
            if urls and back is not None:
                await back(pool, urls)
