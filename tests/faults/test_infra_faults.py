"""The directory's Redis killed and restarted, and the router killed and respawned, under load."""

from __future__ import annotations

import time

import httpx2
import pytest
import redis

from kvwire.connectors.directory.directory import KVDirectory
from tests.faults.harness import (
    REQUEST_TIMEOUT_S,
    SLACK_S,
    body_for,
    judge,
    metric,
    post,
    restart_router,
    send_all,
    wait_recovered,
    wait_until,
)
from tests.faults.test_node_faults import MEDIUM, SHORT, assert_recovered_and_serving, reference

pytestmark = pytest.mark.slow
HEARTBEAT_S = 5.0 / 3  # NodeConfig.heartbeat_ttl_s / 3


def decode_busy(cluster) -> bool:
    url = cluster.ops_urls["decode"]
    return any((metric(url, "kvwire_queue_depth", queue=q) or 0) > 0 for q in ("decode_awaiting_kv", "decode_running"))


def test_redis_killed_and_restarted_mid_load(cluster, tiny_model_dir, tally):
    redis_server = cluster.redis
    assert redis_server is not None, "the cluster must own its Redis to kill it"
    expected = reference(tiny_model_dir, MEDIUM, 12)
    futures = send_all(cluster.url, MEDIUM, 12)
    assert wait_until(lambda: decode_busy(cluster), 30, 0.02)
    redis_server.kill()
    tally.faults += 1
    during = [post(cluster.url, body_for(SHORT[0], 4), REQUEST_TIMEOUT_S + SLACK_S) for _ in range(2)]
    time.sleep(1.0)
    redis_server.restart()  # an empty server on the same port: nodes re-register at their next heartbeat
    judge([f.result() for f in futures], expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    judge(during, reference(tiny_model_dir, SHORT[:1], 4) * 2, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    print(f"\nwhile Redis was down: statuses {[o.status for o in during]}")
    assert tally.lost == 0
    # Without the directory the router cannot pick nodes (503), except from the node list it read less than
    # router.placement.NODES_FRESH_S before: those requests are served (judged exact above) or fail clearly.
    assert all(o.status in (200, 503) for o in during)
    healthy = lambda: httpx2.get(f"{cluster.url}/healthz", timeout=3).status_code == 200  # noqa: E731
    assert wait_until(healthy, 10, 0.25), "nodes did not re-register in the restarted Redis"
    # Over TCP a producer checks the puller's published address, which the empty Redis lost: the
    # first pull after the restart may be refused (exact output, recomputed); the decode node then
    # republishes its address, and the next request bypasses again.
    assert_recovered_and_serving(cluster, tiny_model_dir, tally, bypass=False)
    assert_recovered_and_serving(cluster, tiny_model_dir, tally, bypass=True)


def test_router_killed_and_respawned_mid_load(cluster, tiny_model_dir, tally):
    expected = reference(tiny_model_dir, MEDIUM, 12)
    futures = send_all(cluster.url, MEDIUM, 12)
    assert wait_until(lambda: decode_busy(cluster), 30, 0.02)
    nodes = {r: cluster.procs[r].pid for r in ("prefill", "decode")}
    restart_router(cluster)  # SIGKILL; the supervisor starts another on the same port
    tally.faults += 1
    outcomes = [f.result() for f in futures]
    # Clients of the killed router lose their connection; that is the error they get.
    judge(outcomes, expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S, allow_disconnect=True)
    assert tally.lost == 0
    assert {r: cluster.procs[r].pid for r in nodes} == nodes and all(cluster.procs[r].poll() is None for r in nodes)
    # The decode node finishes the orphaned requests (their tokens go nowhere) and frees their blocks.
    left = wait_recovered(cluster)
    assert left.leaked_blocks == 0 and not left.orphans, left
    outcomes = [f.result() for f in send_all(cluster.url, MEDIUM, 12)]
    judge(outcomes, expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S, require_bypass=True)
    assert tally.lost == 0 and all(o.status == 200 for o in outcomes)
    assert_recovered_and_serving(cluster, tiny_model_dir, tally)


def test_redis_flushall_mid_load(cluster, tiny_model_dir, tally):
    """Redis loses every key (FLUSHALL; a restart without persistence is the same) with requests in flight:
    nodes re-register within one heartbeat, in-flight requests complete (recomputed where their entry went)
    or fail retryably, and nothing hangs or leaks."""
    expected = reference(tiny_model_dir, MEDIUM, 12)
    futures = send_all(cluster.url, MEDIUM, 12)
    assert wait_until(lambda: decode_busy(cluster), 30, 0.02)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        client.flushall()
        flushed_at = time.monotonic()
        tally.faults += 1
        registered = lambda: len(KVDirectory(cluster.redis_url).live_nodes()) == 2  # noqa: E731
        assert wait_until(registered, HEARTBEAT_S + SLACK_S, 0.05)
        print(f"\nboth nodes registered again {time.monotonic() - flushed_at:.2f}s after FLUSHALL")
    finally:
        client.close()
    judge([f.result() for f in futures], expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    assert tally.lost == 0
    # the decode node republished its transport address with that beat: the next request bypasses again
    assert_recovered_and_serving(cluster, tiny_model_dir, tally, bypass=True)
