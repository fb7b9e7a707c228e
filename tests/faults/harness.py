"""What the fault tests share: a cluster whose parts can be killed and brought back,
requests that may fail, and the checks every fault must pass afterwards.

A fault test sends requests, injects a fault with real signals to real processes,
and then holds the cluster to one rule: every request the router accepted either
completed with exactly the single-process tokens or got an OpenAI-shaped error
response within its deadline; once the fault clears the surviving pools are full,
the directory holds nothing that will outlive one entry TTL, and new requests are
served. `Tally` counts what happened so the totals can be quoted (`pytest -s`).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
import redis

from kvwire.cluster.local_cluster import LocalCluster
from kvwire.connectors.directory.directory import TERMINAL_STATES, KVDirectory

BS = 16
KV_DEADLINE_S = 2.0
REQUEST_TIMEOUT_S = 6.0  # the router's, so a stuck request is answered 504 well within a test
ENTRY_TTL_S = 60.0  # what cli/options.py gives every request key at this KV deadline
SLACK_S = 5.0  # scheduling noise on a shared 2-core machine


@dataclass
class Tally:
    """Counts of one test, added into the session's totals."""

    faults: int = 0
    requests: int = 0
    completed: int = 0
    recomputed: int = 0  # of the completed: the decode node computed the prompt (its KV did not come)
    errors: int = 0  # answered with an error response (or the connection closed by a killed router)
    lost: int = 0  # hung past its deadline, wrong tokens, or a 5xx/odd body nobody can act on
    leaked_blocks: int = 0
    malformed: int = 0

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def line(self, what: str) -> str:
        return (f"[{what}] faults={self.faults} requests={self.requests} completed={self.completed} "
                f"(recomputed={self.recomputed}) "
                f"errors={self.errors} lost={self.lost} leaked_blocks={self.leaked_blocks} malformed={self.malformed}")


@dataclass
class Outcome:
    status: int | None  # None: no HTTP answer (connection failed)
    body: dict | None
    elapsed_s: float
    error: str = ""


def post(url: str, body: dict, timeout_s: float) -> Outcome:
    """POST one completion; never raises."""
    start = time.monotonic()
    try:
        resp = httpx2.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    except httpx2.HTTPError as exc:
        return Outcome(None, None, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
    try:
        data = resp.json()
    except ValueError:
        data = None
    return Outcome(resp.status_code, data, time.monotonic() - start)


def body_for(prompt, max_tokens: int, n: int = 1) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, "n": n}


def send_all(url: str, prompts: list, max_tokens: int, timeout_s: float = REQUEST_TIMEOUT_S + 30,
             n: int = 1) -> list[cf.Future]:
    """Start every prompt at once on its own thread (`n` choices each); the futures resolve to Outcomes."""
    pool = cf.ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(post, url, body_for(p, max_tokens, n), timeout_s) for p in prompts]
    pool.shutdown(wait=False)
    return futures


def judge(outcomes: list[Outcome], expected: list[list[int]], tally: Tally, *, deadline_s: float,
          allow_disconnect: bool = False, require_bypass: bool | None = None) -> None:
    """Count each outcome as completed, errored or lost (see the module docstring)."""
    tally.requests += len(outcomes)
    for out, want in zip(outcomes, expected):
        if out.elapsed_s > deadline_s:
            tally.lost += 1
        elif out.status == 200 and out.body and all(c["token_ids"] == want for c in out.body["choices"]):
            ok_bypass = require_bypass is None or out.body["kvwire"]["bypassed"] is require_bypass
            reports = out.body["kvwire"].get("choices", [out.body["kvwire"]])  # every choice's (n > 1)
            if any(_silent_recompute(r) for r in reports):
                ok_bypass = False
                print(f"silent recompute (no transfer_failure named): {out.body['kvwire']}")
            tally.completed += ok_bypass
            tally.recomputed += ok_bypass and not out.body["kvwire"]["bypassed"]
            tally.lost += not ok_bypass
        elif out.status is not None and 400 <= out.status < 600 and is_openai_error(out.body):
            tally.errors += 1
        elif out.status is None and allow_disconnect:
            tally.errors += 1
        else:
            tally.lost += 1
            print(f"lost: status={out.status} elapsed={out.elapsed_s:.1f}s body={str(out.body)[:300]} {out.error}")


def _silent_recompute(report: dict) -> bool:
    """A prompt sent to a prefill node, recomputed on decode, with no reason given."""
    return report["path"] == "disaggregated" and not report["bypassed"] and not report.get("transfer_failure")


def is_openai_error(body: dict | None) -> bool:
    err = (body or {}).get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"]) and "type" in err


# --- metrics ------------------------------------------------------------------------------


def metric(ops_url: str, name: str, **labels: str) -> float | None:
    """One sample of a process's /metrics, or None if it cannot be read."""
    try:
        text = httpx2.get(f"{ops_url}/metrics", timeout=3).text
    except httpx2.HTTPError:
        return None
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if want else rf"^{re.escape(name)} (\S+)$",
                      text, re.M)
    return float(match.group(1)) if match else None


def pool(ops_url: str) -> tuple[int, int] | None:
    """(free, total) blocks of a node, from its /metrics."""
    free = metric(ops_url, "kvwire_kv_blocks", state="free")
    used = metric(ops_url, "kvwire_kv_blocks", state="used")
    return None if free is None or used is None else (int(free), int(free + used))


def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> bool:
    """Poll `pred` (a process's state seen from outside has no event to wait on) until true or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


# --- cluster surgery ---------------------------------------------------------------------


def crash(cluster: LocalCluster, name: str, sig: int = signal.SIGKILL) -> int:
    """Kill child `name` with `sig` behind the cluster's back, as a crash would; returns its pid. The
    cluster's supervisor restarts it (cluster/supervisor.py)."""
    pid = cluster.procs[name].pid
    os.kill(pid, sig)
    return pid


def wait_restarted(cluster: LocalCluster, name: str, old_pid: int, timeout_s: float = 90.0) -> None:
    """Wait until the supervisor has replaced `old_pid` and the new process is ready: the router's /healthz
    answers 200, a node's /readyz says it is registered."""
    url = cluster.url + "/healthz" if name == "router" else cluster.ops_urls[name] + "/readyz"

    def ready() -> bool:
        proc = cluster.procs[name]
        if proc.pid == old_pid or proc.poll() is not None:
            return False
        try:
            return httpx2.get(url, timeout=2).status_code == 200
        except httpx2.HTTPError:
            return False

    assert wait_until(ready, timeout_s, 0.1), f"{name} not restarted and ready within {timeout_s:.0f}s"


def restart_router(cluster: LocalCluster, sig: int = signal.SIGKILL) -> None:
    """Kill the router with `sig`; the supervisor starts a fresh one on the same port."""
    wait_restarted(cluster, "router", crash(cluster, "router", sig))



def live_processes(cluster: LocalCluster) -> dict[str, bool]:
    return {name: proc.poll() is None for name, proc in cluster.procs.items()}


# --- after the fault ---------------------------------------------------------------------------


@dataclass
class Leftovers:
    pools: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)  # entries that will not vanish within one TTL

    @property
    def leaked_blocks(self) -> int:
        return sum(total - free for free, total in (p for p in self.pools.values() if p))


def orphans(redis_url: str) -> list[str]:
    """Request entries that are not terminal, or whose keys would outlive one entry TTL."""
    directory = KVDirectory(redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        bad = []
        for rid in directory.request_ids():
            entry = directory.get(rid)
            ttl = client.pttl(f"{directory.namespace}:req:{rid}")
            if entry is not None and (entry.state not in TERMINAL_STATES or not 0 < ttl <= ENTRY_TTL_S * 1000):
                bad.append(f"{rid}:{entry.state}:ttl={ttl}")
        return bad
    finally:
        client.close()
        directory.close()


def wait_recovered(cluster: LocalCluster, roles=("prefill", "decode"), timeout_s: float = 20.0) -> Leftovers:
    """Wait for every surviving node's pool to be full and no orphaned entry to remain."""
    seen = Leftovers()

    def done() -> bool:
        seen.pools = {r: pool(cluster.ops_urls[r]) for r in roles}
        if any(p is None or p[0] != p[1] for p in seen.pools.values()):
            return False
        seen.orphans = orphans(cluster.redis_url)
        return not seen.orphans

    wait_until(done, timeout_s, 0.25)
    return seen
