"""A cluster sharing an auth secret serves as usual; messages without the secret are dropped and counted."""

from __future__ import annotations

import time

import pytest
import zmq

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.control import auth
from kvwire.connectors.control.framing import pack
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import encode
from kvwire.protocol.work import PrefillWork
from tests.integration.cluster import complete_all
from tests.integration.test_observability import one, scrape
from tests.procs import FORK

pytestmark = pytest.mark.slow


def _push(address: str, data: bytes) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send(data)
    sock.close()


def test_authenticated_cluster_serves_and_drops_strangers(tiny_model_dir, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"cluster-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.TCP, num_blocks=128,
                       auth_secret_file=secret, log_dir=tmp_path / "logs", launch=FORK)
    with LocalCluster(spec) as cluster:
        [first] = complete_all(cluster.url, ["sealed end to end"], max_tokens=4)
        assert first["kvwire"]["bypassed"]
        directory = KVDirectory(cluster.redis_url)
        [prefill] = directory.live_nodes(NodeRole.PREFILL)
        directory.close()
        stranger = PrefillWork(request_id="intruder", prompt_token_ids=[1, 2, 3])
        _push(prefill.work_endpoint, encode(stranger))  # no seal
        try:
            auth.install(b"wrong-secret-0123456789abcdef")
            _push(prefill.work_endpoint, pack(stranger))  # sealed with another secret
        finally:
            auth.install(None)
        deadline = time.monotonic() + 10
        while one(scrape(cluster.ops_urls["prefill"]), "kvwire_messages_rejected_total",
                  reason="unauthenticated") < 2:
            assert time.monotonic() < deadline, "the prefill node did not count both strangers"
            time.sleep(0.1)
        [again] = complete_all(cluster.url, ["sealed end to end"], max_tokens=4)
        assert again["kvwire"]["bypassed"] and again["choices"][0]["text"] == first["choices"][0]["text"]
        assert one(scrape(cluster.ops_urls["prefill"]), "kvwire_kv_blocks",
                   state="used") == 0
