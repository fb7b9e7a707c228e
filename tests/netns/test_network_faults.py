"""Network faults on the two-host topology, with requests in flight (issue 17, part 3).

Each test cuts something, lets it heal, and then holds the cluster to the rule of
tests/faults/harness.py: every request completed with exactly the single-process tokens
(recomputed by the decode node where its KV could not come) or got a retryable error
response, within the router's request timeout + 2 s; nothing lost; once healed, both
pools full, no directory entry that outlives its TTL, and a new request served over the
transfer plane again by the very same processes (no restart). Counts go to the fault
matrix printed at the end of the session (tests/netns/matrix.py).
"""

from __future__ import annotations

import signal
import time

import pytest

from kvwire.cluster.supervisor import ChildProcess
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.faults.harness import (
    REQUEST_TIMEOUT_S,
    Outcome,
    Tally,
    body_for,
    is_openai_error,
    judge,
    metric,
    post,
    send_all,
    wait_recovered,
    wait_until,
)
from tests.netns.cluster import BS, HEARTBEAT_TTL_S, REDIS_TIMEOUT_S, NetnsCluster
from tests.netns.matrix import record

pytestmark = pytest.mark.slow

DEADLINE_S = REQUEST_TIMEOUT_S + 2.0  # the bound: a request's deadline + 2 s
HEAL_AFTER_S = 3.0  # past the KV deadline (KV_DEADLINE_S, 2 s): pulls in flight give up, then it heals
REDIS_CUT_S = HEARTBEAT_TTL_S + REDIS_TIMEOUT_S  # past the decode node's lease and its Redis command timeout
LONG = [list(range(i, i + 250)) * 2 + [i] for i in range(4)]  # 501 tokens: KV worth pulling
SHORT = [[ord(c) for c in f"silent host {i}"] for i in range(3)]
MAX_TOKENS = 6
HEARTBEAT_S = HEARTBEAT_TTL_S / 3  # connectors/directory/heartbeat.py


def reference(model_dir, prompts) -> list[list[int]]:
    return generate(model_dir, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), block_size=BS)


def held(cluster: NetnsCluster) -> float:
    return metric(cluster.ops_urls["prefill"], "kvwire_queue_depth", queue="prefill_held") or 0.0


def pids(cluster: NetnsCluster) -> dict[str, int]:
    return {role: cluster.procs[role].pid for role in ("prefill", "decode")}


def assert_same_processes(cluster: NetnsCluster, before: dict[str, ChildProcess], connector: ConnectorKind) -> None:
    """No node died during the fault. Over UCX's TCP transport a prefill node used to, in UCX 1.21, after it
    force-closed a pull's endpoints with a send stuck in one (README Known limits): it parks them now."""
    died = {role: proc.returncode for role, proc in before.items() if cluster.procs[role] is not proc}
    assert not died, f"nodes died during the fault over {connector} (exit codes): {died}"


def settle(cluster: NetnsCluster, model_dir, tally: Tally) -> None:
    """After the fault: no leak, no orphan, and a request served over the transfer plane again.

    A node whose lease ran out during the fault is back at its next heartbeat; until then
    the router answers 503 (retryable), which is waited out here.
    """
    healed_at = time.monotonic()
    left = wait_recovered(cluster, timeout_s=30)
    tally.leaked_blocks += left.leaked_blocks
    assert left.leaked_blocks == 0 and not left.orphans, left
    prompt = [ord(c) for c in "after the network fault"]
    want = reference(model_dir, [prompt])

    def bypassed() -> bool:  # the first one may still find the old connection broken, and recompute
        out = post(cluster.url, body_for(prompt, MAX_TOKENS), DEADLINE_S)
        if out.status == 503 and is_openai_error(out.body):
            return False
        assert out.status == 200 and out.body["choices"][0]["token_ids"] == want[0], out
        return bool(out.body["kvwire"]["bypassed"])

    assert wait_until(bypassed, 20, 0.25), "the transfer plane did not come back"
    print(f"served over the transfer plane again {time.monotonic() - healed_at:.1f}s after the fault healed")


def test_data_link_down_mid_transfer(cluster, connector, tiny_model_dir):
    """The A-B link goes down while KV moves (slowed to 50 Mbit/s so it is mid-stream), up HEAL_AFTER_S later."""
    tally, before = Tally(), {role: cluster.procs[role] for role in ("prefill", "decode")}
    expected = reference(tiny_model_dir, LONG)
    shaped = cluster.topo.shape_data("50mbit")  # best effort: without tc the transfers are just quicker
    try:
        first = send_all(cluster.url, LONG[:3], MAX_TOKENS, DEADLINE_S + 5)
        hit = wait_until(lambda: held(cluster) > 0, 20, 0.01)
        time.sleep(0.05)  # into the bytes
        outcomes = fault_window(cluster, lambda up: cluster.topo.data_link(up), first, LONG[3:], tally)
    finally:
        cluster.topo.shape_data(None)
    judge(outcomes, expected, tally, deadline_s=DEADLINE_S)
    print(f"\n[{connector}] data link down (shaped: {shaped}, KV held when cut: {hit}): {summary(outcomes)}")
    record(f"data link down {HEAL_AFTER_S:.0f} s", connector, tally)
    assert tally.lost == 0
    assert tally.recomputed + tally.errors >= 1, "the fault landed after every request had its KV"
    settle(cluster, tiny_model_dir, tally)
    assert_same_processes(cluster, before, connector)


def test_decode_loses_redis(cluster, connector, tiny_model_dir):
    """The decode node's path to Redis (only) goes silent for longer than its lease, with requests before
    the cut and after its lease ran out (the router no longer lists it: 503, retryable)."""
    tally, before = Tally(), pids(cluster)
    expected = reference(tiny_model_dir, LONG)
    first = send_all(cluster.url, LONG[:3], MAX_TOKENS, DEADLINE_S + 5)
    outcomes = fault_window(cluster, lambda up: cluster.topo.redis_link(cluster.topo.b, up), first, LONG[3:], tally,
                            heal_after_s=REDIS_CUT_S, send_at_s=REDIS_CUT_S - 1.0)
    judge(outcomes, expected, tally, deadline_s=DEADLINE_S)
    print(f"\n[{connector}] decode cut from Redis: {summary(outcomes)}")
    record(f"decode-Redis link down {REDIS_CUT_S:.0f} s", connector, tally)
    assert tally.lost == 0
    settle(cluster, tiny_model_dir, tally)
    assert pids(cluster) == before


def fault_window(cluster, link, first, during: list, tally: Tally, *, heal_after_s: float = HEAL_AFTER_S,
                 send_at_s: float = 1.0) -> list[Outcome]:
    """Cut `link`, send `during` send_at_s into the cut, heal it heal_after_s after the cut; all outcomes."""
    link(False)
    tally.faults += 1
    try:
        time.sleep(send_at_s)
        second = send_all(cluster.url, during, MAX_TOKENS, DEADLINE_S + 5)
        time.sleep(heal_after_s - send_at_s)
    finally:
        link(True)
    return [f.result() for f in [*first, *second]]


def summary(outcomes: list[Outcome]) -> list:
    return [(o.status, round(o.elapsed_s, 1), o.status == 200 and o.body["kvwire"]["bypassed"]) for o in outcomes]


def registered_epoch(cluster: NetnsCluster) -> int | None:
    directory = KVDirectory(cluster.redis_url)
    try:
        info = directory.get_node("prefill-0")
        return None if info is None else info.epoch
    finally:
        directory.close()


def test_prefill_silent_past_its_lease(cluster, connector, tiny_model_dir):
    """SIGSTOP past the lease, SIGCONT: the node comes back by itself, and its work is exact."""
    tally, before = Tally(), pids(cluster)
    expected = reference(tiny_model_dir, SHORT)
    prefill = cluster.procs["prefill"]
    prefill.send_signal(signal.SIGSTOP)
    tally.faults += 1
    try:
        futures = send_all(cluster.url, SHORT, MAX_TOKENS, DEADLINE_S + 5)  # routed to it while still listed
        assert wait_until(lambda: registered_epoch(cluster) is None, 15, 0.2), "the lease did not expire"
        outcomes = [f.result() for f in futures]
    finally:
        prefill.send_signal(signal.SIGCONT)
    judge(outcomes, expected, tally, deadline_s=DEADLINE_S)
    print(f"\n[{connector}] prefill stopped past its lease: {summary(outcomes)}")
    record("prefill SIGSTOP past lease, SIGCONT", connector, tally)
    assert tally.lost == 0
    settle(cluster, tiny_model_dir, tally)
    assert pids(cluster) == before


def test_fenced_prefill_serves_nothing_and_a_restart_is_used_within_a_heartbeat(cluster, connector, tiny_model_dir):
    """A replacement took the stopped node's id (a higher epoch) before it woke: what it computes
    after SIGCONT must never be served; the restarted node is picked within one heartbeat."""
    tally = Tally()
    expected = reference(tiny_model_dir, SHORT)
    prefill = cluster.procs["prefill"]
    old_epoch = registered_epoch(cluster)
    prefill.send_signal(signal.SIGSTOP)
    tally.faults += 1
    try:
        futures = send_all(cluster.url, SHORT, MAX_TOKENS, DEADLINE_S + 5)
        assert wait_until(lambda: registered_epoch(cluster) is None, 15, 0.2), "the lease did not expire"
        directory = KVDirectory(cluster.redis_url)
        try:
            directory.next_epoch("prefill-0")  # what a replacement incarnation does first
        finally:
            directory.close()
    finally:
        prefill.send_signal(signal.SIGCONT)
    outcomes = [f.result() for f in futures]
    judge(outcomes, expected, tally, deadline_s=DEADLINE_S)
    time.sleep(2 * HEARTBEAT_S)  # the fenced process has woken and tried to beat (and publish)
    assert registered_epoch(cluster) is None, "a fenced incarnation registered again"
    cluster.restart_node("prefill")
    ready_at = time.monotonic()
    new_epoch = registered_epoch(cluster)
    assert new_epoch is not None and old_epoch is not None and new_epoch > old_epoch + 1
    used = wait_until(lambda: _served_by_prefill(cluster), 10, 0.1)
    used_after = time.monotonic() - ready_at
    print(f"\n[{connector}] fenced prefill: {summary(outcomes)}; "
          f"restarted node used {used_after:.2f}s after it was ready")
    record("prefill fenced (new epoch) + restart", connector, tally)
    assert tally.lost == 0 and used and used_after <= HEARTBEAT_S
    settle(cluster, tiny_model_dir, tally)


def _served_by_prefill(cluster: NetnsCluster) -> bool:
    out = post(cluster.url, body_for([ord(c) for c in "are you back"], 2), DEADLINE_S)
    return out.status == 200 and bool(out.body["kvwire"]["bypassed"])
