"""A request id sent twice to a prefill node is computed once; no block is leaked (real processes)."""

from __future__ import annotations

import time

import pytest
import zmq

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import encode
from kvwire.protocol.work import PrefillWork
from tests.integration.test_observability import one, scrape
from tests.procs import FORK

pytestmark = pytest.mark.slow


def test_duplicate_prefill_work_is_dropped_and_blocks_return(tiny_model_dir, tmp_path):
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.TCP, num_blocks=64, kv_deadline_s=1.0,
                       log_dir=tmp_path / "logs", launch=FORK)
    with LocalCluster(spec) as cluster:
        directory = KVDirectory(cluster.redis_url)
        [prefill] = directory.live_nodes(NodeRole.PREFILL)
        directory.close()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(prefill.work_endpoint)
        for _ in range(3):  # nobody pulls it: held until its hold deadline (1 s), then released
            push.send(encode(PrefillWork(request_id="dup-1", prompt_token_ids=list(range(40)))))
        push.close()
        url = cluster.ops_urls["prefill"]
        deadline = time.monotonic() + 15
        while one(scrape(url), "kvwire_kv_blocks", state="used") != 0 or time.monotonic() < deadline - 12:
            assert time.monotonic() < deadline, "the prefill node's pool did not return to full"
            time.sleep(0.2)
        assert "duplicate dropped" in (tmp_path / "logs" / "prefill.log").read_text()
