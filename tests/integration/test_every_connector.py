"""The whole cluster over each connector: outputs equal the single-process run, prompts bypassed."""

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
        pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
        assert all(free == total for free, total in pools.values()) and leftover == []
