"""The whole cluster over each connector: outputs equal the single-process run, prompts bypassed; a prompt
continuing one the decode node holds in its prefix cache pulls only its tail."""

from __future__ import annotations

import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import complete_all, wait_pools_full_and_directory_empty
from tests.procs import FORK

pytestmark = pytest.mark.slow
PROMPTS = [[72], list(range(16)), list(range(33)), list(range(100, 200)) * 11]
# the transport a local cluster's transfers must report, per connector
EXPECTED_TRANSPORT = {"auto": "shm"}
BLOCK_SIZE = 16  # ClusterSpec's default


def test_cluster_over_connector(connector_kind: ConnectorKind, tiny_model_dir, tmp_path):
    expected = generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=connector_kind, num_blocks=256, log_dir=tmp_path / "logs",
                       launch=FORK)
    with LocalCluster(spec) as cluster:
        results = complete_all(cluster.url, PROMPTS, max_tokens=8)
        for want, got in zip(expected, results):
            assert got["choices"][0]["token_ids"] == want
            assert got["kvwire"]["bypassed"] is True
            assert got["kvwire"]["transport"] == EXPECTED_TRANSPORT.get(connector_kind.value, connector_kind.value)
        tail_pulled(cluster.url, tiny_model_dir, PROMPTS[3], results[3])
        pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
        assert all(free == total for free, total in pools.values()) and leftover == []


def tail_pulled(url: str, model_dir, before: list[int], answered: dict) -> None:
    """A prompt that continues `before` and its answer `answered` (the next turn) starts on the decode node's
    cached blocks of both (the answer's last token has no KV yet) and pulls only the blocks after them: fewer
    bytes, the same tokens as the single-process run."""
    answer = answered["choices"][0]["token_ids"]
    prompt = before + answer + list(range(250, 290))
    want = generate(model_dir, [prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    got = complete_all(url, [prompt], max_tokens=8)[0]
    kv, whole = got["kvwire"], answered["kvwire"]
    assert got["choices"][0]["token_ids"] == want and kv["bypassed"] is True, kv
    assert kv["cached_tokens"] == (len(before) + len(answer) - 1) // BLOCK_SIZE * BLOCK_SIZE, kv
    assert 0 < kv["kv_bytes"] < whole["kv_bytes"] * (len(prompt) - kv["cached_tokens"] + BLOCK_SIZE) / len(before)
