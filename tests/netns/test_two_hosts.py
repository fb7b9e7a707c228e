"""Every connector moves KV between two "hosts" (network namespaces): outputs equal the single-process run.

The prefill node runs in namespace A and the decode node in namespace B (tests/netns/topology.py),
each with `--host 0.0.0.0` and no `--advertise-host`: each must publish the address of its own
interface towards Redis, and 127.0.0.1 names only itself.
"""

from __future__ import annotations

import pytest

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.faults.harness import REQUEST_TIMEOUT_S, SLACK_S, send_all, wait_recovered
from tests.netns.cluster import BS, WORK_PORT

pytestmark = pytest.mark.slow

PROMPTS = [[72], list(range(40)), list(range(100, 300))]
MAX_TOKENS = 6
# what the response's kvwire.transport must say: auto picks UCX for a producer on another host
EXPECTED_TRANSPORT = {ConnectorKind.AUTO: "ucx"}


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    return generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), block_size=BS)


def test_each_node_publishes_its_own_address(cluster):
    directory = KVDirectory(cluster.redis_url)
    try:
        nodes = {n.node_id: n for n in directory.live_nodes()}
    finally:
        directory.close()
    assert nodes["prefill-0"].work_endpoint == f"tcp://{cluster.topo.a.address}:{WORK_PORT}"
    assert nodes["decode-0"].work_endpoint == f"tcp://{cluster.topo.b.address}:{WORK_PORT}"


def test_kv_moves_across_hosts(cluster, connector, expected):
    outcomes = [f.result() for f in send_all(cluster.url, PROMPTS, MAX_TOKENS, REQUEST_TIMEOUT_S + SLACK_S)]
    for out, want in zip(outcomes, expected):
        assert out.status == 200, out
        assert out.body["choices"][0]["token_ids"] == want
        assert out.body["kvwire"]["bypassed"] is True, out.body["kvwire"]
        assert out.body["kvwire"]["transport"] == EXPECTED_TRANSPORT.get(connector, str(connector))
    left = wait_recovered(cluster)
    assert left.leaked_blocks == 0 and not left.orphans, left
