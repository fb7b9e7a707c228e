"""KVReady, the producer's direct word to the consumer: ordering against the directory, and who may use it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.directory import KVDirectory, TransferState
from kvwire.connectors.factory import create_connector
from kvwire.connectors.held import HeldTable
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.producer import KVProducer
from kvwire.connectors.wire import KVLocation, PullRequest
from kvwire.engine.kv_cache import KVPool
from kvwire.engine.model_input import ModelInput, SequenceInput
from tests.connectors import peer


def _config(role: NodeRole, node_id: str, redis_url: str) -> ConnectorConfig:
    return ConnectorConfig(kind=ConnectorKind.TCP, role=role, node_id=node_id, redis_url=redis_url)


def test_a_pull_delivered_before_the_ready_lands_is_recorded_after_it(redis_url):
    """A consumer told directly can finish its pull before the producer's READY reaches the directory; the
    CONSUMED + delete must then follow the READY, or the entry would be left READY for good."""
    directory = KVDirectory(redis_url)
    region = KVRegion.from_kv_caches(KVPool.allocate(peer.layout(), 8, "cpu").kv_caches)
    released = []
    server = SimpleNamespace(side_channel="tcp://127.0.0.1:1", transport_address=b"127.0.0.1:2", wake=lambda: None)
    sender = KVProducer(_config(NodeRole.PREFILL, "p-ready", redis_url), directory, region,
                      HeldTable(released.append), {ConnectorKind.TCP: server}, directory.next_epoch("p-ready"))
    seen: list[KVLocation] = []

    def pulled_at_once(loc: KVLocation) -> None:  # the whole pull, inside the direct word
        seen.append(loc)
        sender.on_delivered(PullRequest(request_id=loc.request_id, transfer_id=1, consumer="d", transport_address=b"",
                                        dst_block_ids=[0, 1]), "tcp", 100)

    sender.on_located = pulled_at_once
    sender.publish(ModelInput([SequenceInput("early-1", [0] * 5, 0, [2, 3])]), torch.zeros(5, peer.HIDDEN))
    assert [loc.request_id for loc in seen] == ["early-1"] and seen[0].block_ids == [2, 3]
    assert directory.get("early-1") is None, "the entry must end CONSUMED and deleted, not stay READY"
    directory.close()


def test_the_consumer_takes_a_direct_location_only_for_a_request_it_expects(redis_url):
    conn = create_connector(0, 0, _config(NodeRole.DECODE, "d-ready", redis_url))
    pool = conn.allocate_kv_pool(peer.layout(), 8, "cpu")
    conn.register_kv_caches(pool.kv_caches)
    loc = KVLocation(request_id="direct-1", producer="p", producer_epoch=1, kind=ConnectorKind.TCP,
                     side_channel="tcp://127.0.0.1:1", transport_address=b"127.0.0.1:2", layout=peer.layout(),
                     block_ids=[0], num_tokens=3, hidden=[])
    try:
        assert not conn.kv_located(loc), "not expected yet: ignored"
        woke = []
        conn.expect("direct-1", woke.append)
        assert conn.kv_located(loc)
        assert conn._ready["direct-1"].state == TransferState.READY  # recv starts from it: no directory read
    finally:
        conn.close()
