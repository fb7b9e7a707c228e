"""A cluster whose prefill node streams KV layer by layer: outputs equal the single-process run, prompts bypassed,
every block freed, the directory left empty; and a prefill node killed mid-stream costs recomputes, never a request."""

from __future__ import annotations

import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.faults.harness import (
    BS,
    KV_DEADLINE_S,
    REQUEST_TIMEOUT_S,
    SLACK_S,
    Tally,
    crash,
    judge,
    metric,
    send_all,
    wait_recovered,
    wait_restarted,
    wait_until,
)
from tests.integration.cluster import complete_all, wait_pools_full_and_directory_empty
from tests.procs import FORK

pytestmark = pytest.mark.slow
PROMPTS = [[72], list(range(16)), list(range(33)), list(range(100, 200)) * 11]
LONG = [list(range(i, i + 250)) * 2 + [i] for i in range(4)]  # the prefill node is busy for a while


@pytest.fixture(scope="module", params=[ConnectorKind.TCP, ConnectorKind.UCX])
def cluster(request, tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=request.param, num_blocks=256, block_size=BS,
                       kv_deadline_s=KV_DEADLINE_S, layerwise=True, log_dir=tmp_path_factory.mktemp("lw-logs"),
                       launch=FORK)
    with LocalCluster(spec) as c:
        yield c


def test_layerwise_cluster_matches_single_process(cluster, tiny_model_dir):
    expected = generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0), block_size=BS)
    results = complete_all(cluster.url, PROMPTS, max_tokens=8)
    for want, got in zip(expected, results):
        assert got["choices"][0]["token_ids"] == want
        assert got["kvwire"]["bypassed"] is True
        assert got["kvwire"]["transport"] == cluster.spec.connector
    pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
    assert all(free == total for free, total in pools.values()) and leftover == []


def test_prompts_streamed_past_a_cached_prefix_match_single_process(cluster, tiny_model_dir):
    """The prefill node's prefix cache: a later prompt after one system prompt computes only its rest, and its
    stream carries the cached blocks' layers with the computed ones; the decode node, holding the system prompt's
    blocks too, pulls only the later blocks' layers."""
    system = list(range(10, 90))  # 80 tokens: 5 full blocks
    prompts = [system + [q] * (40 + q) for q in (5, 6, 7)]
    expected = generate(tiny_model_dir, prompts, SamplingParams(max_tokens=8, temperature=0.0), block_size=BS)
    before = metric(cluster.ops_urls["prefill"], "kvwire_prompt_tokens_cached_total") or 0
    for prompt, want in zip(prompts, expected):  # one at a time: each finds the one before it cached
        got = complete_all(cluster.url, [prompt], max_tokens=8)[0]
        assert got["choices"][0]["token_ids"] == want and got["kvwire"]["bypassed"] is True
        assert got["kvwire"]["cached_tokens"] == (0 if prompt is prompts[0] else len(system))
    assert (metric(cluster.ops_urls["prefill"], "kvwire_prompt_tokens_cached_total") or 0) - before == 2 * len(system)


def test_prefill_killed_mid_stream_costs_recomputes_not_requests(cluster, tiny_model_dir):
    tally = Tally()
    expected = generate(tiny_model_dir, LONG, SamplingParams(max_tokens=8, temperature=0.0), block_size=BS)
    futures = send_all(cluster.url, LONG, 8)
    # layer-wise, a request is held (and its stream open) from before its forward
    held = lambda: (metric(cluster.ops_urls["prefill"], "kvwire_queue_depth", queue="prefill_held") or 0) > 0  # noqa: E731
    assert wait_until(held, 30, 0.01)
    killed = crash(cluster, "prefill")
    outcomes = [f.result() for f in futures]
    judge(outcomes, expected, tally, deadline_s=REQUEST_TIMEOUT_S + SLACK_S)
    bypassed = sum(o.body["kvwire"]["bypassed"] for o in outcomes if o.status == 200)
    print(f"\nprefill killed mid-stream: {bypassed} of {len(LONG)} bypassed, the rest recomputed")
    assert tally.completed == len(LONG) and tally.lost == 0  # exact outputs; the decode node recomputed what it lost
    wait_restarted(cluster, "prefill", killed)
    left = wait_recovered(cluster)
    assert left.leaked_blocks == 0 and not left.orphans, left
