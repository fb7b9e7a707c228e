"""Prefill and decode nodes SIGKILLed, or SIGSTOPped and continued, with requests in flight.

(test_disaggregated.py kills a prefill node before any request; here the kills land
while requests wait for, or move, their KV.)
"""

from __future__ import annotations

import signal
import time

import pytest

from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.faults.harness import (
    BS,
    KV_DEADLINE_S,
    REQUEST_TIMEOUT_S,
    SLACK_S,
    body_for,
    crash,
    judge,
    metric,
    pool,
    post,
    send_all,
    wait_recovered,
    wait_restarted,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG = [list(range(i, i + 250)) * 2 + [i] for i in range(4)]  # 501 tokens each: the prefill node is busy for a while
MEDIUM = [list(range(3 * i, 3 * i + 150)) + [i] for i in range(4)]
SHORT = [[ord(c) for c in f"fault number {i}"] for i in range(3)]


def reference(model_dir, prompts, max_tokens):
    return generate(model_dir, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), block_size=BS)


def queue_depth(cluster, role: str, queue: str) -> float:
    return metric(cluster.ops_urls[role], "kvwire_queue_depth", queue=queue) or 0.0


def assert_recovered_and_serving(cluster, model_dir, tally, *, bypass: bool = True) -> None:
    """Survivors' pools full, no orphaned entry, and a new request served exactly."""
    left = wait_recovered(cluster)
    tally.leaked_blocks += left.leaked_blocks
    assert left.leaked_blocks == 0 and not left.orphans, left
    prompt = [ord(c) for c in "after the fault"]
    out = post(cluster.url, body_for(prompt, 6), REQUEST_TIMEOUT_S + SLACK_S)
    judge([out], reference(model_dir, [prompt], 6), tally, deadline_s=REQUEST_TIMEOUT_S, require_bypass=bypass or None)
    assert out.status == 200, out
    assert tally.lost == 0


def test_prefill_sigkilled_mid_transfer(cluster, tiny_model_dir, tally):
    """The prefill node dies while it holds published KV its decode node has yet to pull: every request still
    completes, the unpulled ones recomputed, and each request's second choice (n=2), which starts from its first
    one's prompt, answers the same. The decode node is stopped until the kill, so that the kill cannot miss that
    moment (a held request is pulled within milliseconds otherwise)."""
    expected = reference(tiny_model_dir, LONG, 8)
    decode = cluster.procs["decode"]
    decode.send_signal(signal.SIGSTOP)
    try:
        futures = send_all(cluster.url, LONG, 8, n=2)
        assert wait_until(lambda: queue_depth(cluster, "prefill", "prefill_held") > 0, 30, 0.02)
        killed = crash(cluster, "prefill")
    finally:
        decode.send_signal(signal.SIGCONT)
    tally.faults += 1
    outcomes = [f.result() for f in futures]
    judge(outcomes, expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    bypassed = sum(o.body["kvwire"]["bypassed"] for o in outcomes if o.status == 200)
    print(f"\n{bypassed} of {len(LONG)} bypassed, the rest recomputed")
    assert tally.completed == len(LONG), [o.status for o in outcomes]  # decode recomputes: none fails
    assert bypassed < len(LONG), "the held KV was pulled from a dead prefill node?"
    seconds = [o.body["kvwire"]["choices"][1] for o in outcomes]
    assert {(r["reason"], r["kv_bytes"]) for r in seconds} == {("prompt-shared", 0)}, seconds
    wait_restarted(cluster, "prefill", killed)
    assert_recovered_and_serving(cluster, tiny_model_dir, tally)


def test_decode_sigkilled_mid_receive(cluster, tiny_model_dir, tally):
    expected = reference(tiny_model_dir, MEDIUM, 40)
    futures = send_all(cluster.url, MEDIUM, 40)
    busy = lambda: (queue_depth(cluster, "decode", "decode_awaiting_kv")  # noqa: E731
                    + queue_depth(cluster, "decode", "decode_running"))
    assert wait_until(lambda: busy() > 0, 30, 0.02)
    killed = crash(cluster, "decode")
    killed_at = time.monotonic()
    tally.faults += 1
    # The prefill node lets go of KV nobody pulls by its hold deadline.
    assert wait_until(lambda: (p := pool(cluster.ops_urls["prefill"])) is not None and p[0] == p[1],
                      KV_DEADLINE_S + SLACK_S)
    print(f"\nprefill pool full {time.monotonic() - killed_at:.1f}s after the decode node died")
    outcomes = [f.result() for f in futures]
    judge(outcomes, expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    assert tally.lost == 0 and tally.completed + tally.errors == len(MEDIUM)
    assert tally.errors > 0, "the kill landed after every request had finished"
    wait_restarted(cluster, "decode", killed)
    assert_recovered_and_serving(cluster, tiny_model_dir, tally)


def test_decode_stopped_then_continued(cluster, tiny_model_dir, tally):
    expected = reference(tiny_model_dir, SHORT, 8)
    decode = cluster.procs["decode"]
    decode.send_signal(signal.SIGSTOP)
    tally.faults += 1
    try:
        outcomes = [f.result() for f in send_all(cluster.url, SHORT, 8)]
    finally:
        decode.send_signal(signal.SIGCONT)
    judge(outcomes, expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    print(f"\nwhile stopped: statuses {[o.status for o in outcomes]}, "
          f"slowest {max(o.elapsed_s for o in outcomes):.1f}s")
    assert tally.lost == 0 and tally.errors == len(SHORT)  # 504 at the request deadline (503 once it expired)
    assert_recovered_and_serving(cluster, tiny_model_dir, tally)


def test_transfer_deadline_passes_while_prefill_is_stopped(cluster, tiny_model_dir, tally):
    expected = reference(tiny_model_dir, SHORT, 8)
    prefill = cluster.procs["prefill"]
    prefill.send_signal(signal.SIGSTOP)  # still registered for up to one heartbeat TTL: the router picks it
    tally.faults += 1
    try:
        outcomes = [f.result() for f in send_all(cluster.url, SHORT, 8)]
    finally:
        prefill.send_signal(signal.SIGCONT)
    judge(outcomes, expected, tally, deadline_s=KV_DEADLINE_S + SLACK_S, require_bypass=False)
    assert tally.completed == len(SHORT), [(o.status, o.elapsed_s, o.body and o.body.get("kvwire")) for o in outcomes]
    assert all(o.body["kvwire"]["prefill_node"] == "prefill-0" for o in outcomes)  # it was asked, and never answered
    assert_recovered_and_serving(cluster, tiny_model_dir, tally)
