"""The vLLM instances of one role that the router sends requests to, in rotation or out of it.

Lifecycle of an instance:

1. UP from the start: `pick()` hands it out in turn with the other UP instances (round robin).
2. DOWN when a request to it fails to connect, times out or gets a 5xx (`take_out`), or
   when a health probe fails: `pick()` skips it.
3. UP again when a later probe of GET /health answers 200 (`check`, run every
   `health_interval_s` by `run_health_checks`).

A pool lives on one event loop and is not shared between threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from kvwire.connectors.config import NodeRole
from kvwire.observability.labels import InstanceState
from kvwire.router.vllm_upstream import PEER_ERRORS

log = logging.getLogger(__name__)


class Probe(Protocol):
    """Asks one instance whether it serves."""

    async def __call__(self, url: str) -> str | None:
        """Args: url, an instance's base URL. Returns: None when it serves, else why not."""
        ...


@dataclass
class Instance:
    """One vLLM instance: its base URL and whether it is in rotation, since when and why not."""

    url: str
    state: InstanceState = InstanceState.UP
    since: float = 0.0
    reason: str = ""


class InstancePool:
    """The instances of one role; `pick()` rotates over those UP."""

    def __init__(self, role: NodeRole, urls: Sequence[str], clock: Callable[[], float] = time.monotonic):
        self.role = role
        self._clock = clock
        self._instances = {url: Instance(url, since=clock()) for url in urls}
        self._turn = 0

    def pick(self) -> str | None:
        """Returns: the next UP instance's URL in round-robin order; None when none is UP."""
        up = self.urls(InstanceState.UP)
        if not up:
            return None
        self._turn += 1
        return up[(self._turn - 1) % len(up)]

    def urls(self, state: InstanceState) -> list[str]:
        """Returns: the URLs of the instances in `state`, in the order they were configured."""
        return [i.url for i in self._instances.values() if i.state == state]

    def count(self, state: InstanceState) -> int:
        return sum(1 for i in self._instances.values() if i.state == state)

    def take_out(self, url: str, reason: str) -> None:
        """Take `url` out of rotation until a health probe re-admits it.

        Raises:
            KeyError: `url` is not one of this pool's instances.
        """
        instance = self._instances[url]
        if instance.state == InstanceState.UP:
            log.warning("vLLM %s instance %s out of rotation: %s", self.role, url, reason)
            instance.state, instance.since = InstanceState.DOWN, self._clock()
        instance.reason = reason

    def readmit(self, url: str) -> None:
        """Put `url` back in rotation. Raises: KeyError, as `take_out`."""
        instance = self._instances[url]
        if instance.state == InstanceState.DOWN:
            log.info("vLLM %s instance %s back in rotation", self.role, url)
            instance.state, instance.since, instance.reason = InstanceState.UP, self._clock(), ""

    async def check(self, probe: Probe) -> None:
        """Probe every instance at once; re-admit those that serve, take out those that do not."""
        urls = list(self._instances)
        for url, problem in zip(urls, await asyncio.gather(*(probe(url) for url in urls))):
            if problem is None:
                self.readmit(url)
            else:
                self.take_out(url, f"health check: {problem}")

    def describe(self) -> dict[str, object]:
        """Returns: the instances UP and those DOWN with why, for /healthz."""
        now = self._clock()
        return {"up": self.urls(InstanceState.UP),
                "down": [{"url": i.url, "reason": i.reason, "down_s": round(now - i.since, 1)}
                         for i in self._instances.values() if i.state == InstanceState.DOWN]}


class HealthProbe:
    """GET {url}/health, which vLLM answers 200 once its engine serves."""

    def __init__(self, client: httpx.AsyncClient, timeout: httpx.Timeout):
        self._client = client
        self._timeout = timeout

    async def __call__(self, url: str) -> str | None:
        try:
            resp = await self._client.get(f"{url}/health", timeout=self._timeout)
        except PEER_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return None if resp.status_code == 200 else f"GET /health answered {resp.status_code}"


async def run_health_checks(pools: Sequence[InstancePool], probe: Probe, interval_s: float) -> None:
    """Check every pool every `interval_s` seconds, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.gather(*(pool.check(probe) for pool in pools))
