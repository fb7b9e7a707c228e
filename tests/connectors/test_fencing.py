"""Fencing: a producer incarnation older than the latest one cannot publish KV, and a new incarnation fails
the READY entries its earlier ones left (real redis-server)."""

from __future__ import annotations

import msgspec
import pytest

from kvwire.bench.directory import _location
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.batch import DirectoryBatch
from kvwire.connectors.directory.directory import KVDirectory, StaleNodeError, TransferState
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.incarnations import fail_earlier_incarnations
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.transports.kv_region import KVRegion
from tests.connectors import peer


def test_an_old_epoch_is_fenced_off(redis_url):
    d = KVDirectory(redis_url, namespace="fence-test")
    try:
        old = d.next_epoch("bench-prefill")
        new = d.next_epoch("bench-prefill")  # the node restarted
        assert new > old
        stale = msgspec.structs.replace(_location("r-old"), producer_epoch=old)
        with pytest.raises(StaleNodeError, match="stale") as info:
            d.publish_ready(stale)
        assert info.value.request_id == "r-old"
        assert d.get("r-old") is None  # nothing written
        assert d.publish_ready(msgspec.structs.replace(_location("r-new"), producer_epoch=new))
        assert d.get("r-new").state == TransferState.READY
        fenced, fresh = DirectoryBatch(d) \
            .publish_ready(msgspec.structs.replace(_location("b-old"), producer_epoch=old)) \
            .publish_ready(msgspec.structs.replace(_location("b-new"), producer_epoch=new)).execute()
        assert (fenced, fresh) == (False, True) and d.get("b-old") is None
    finally:
        d.close()


def _ready(d: KVDirectory, rid: str, producer: str, epoch: int) -> None:
    assert d.publish_ready(msgspec.structs.replace(_location(rid), producer=producer, producer_epoch=epoch))


def test_a_new_incarnation_fails_only_its_earlier_ones_ready_entries(redis_url):
    d = KVDirectory(redis_url, namespace="incarnation-test")
    try:
        old = d.next_epoch("bench-prefill")
        d.next_epoch("other-prefill")
        _ready(d, "old-a", "bench-prefill", old)
        _ready(d, "old-b", "bench-prefill", old)
        _ready(d, "old-consumed", "bench-prefill", old)
        d.transition("old-consumed", {TransferState.READY}, TransferState.CONSUMED)
        _ready(d, "other", "other-prefill", 1)
        new = d.next_epoch("bench-prefill")
        _ready(d, "new", "bench-prefill", new)
        assert sorted(fail_earlier_incarnations(d, "bench-prefill", new)) == ["old-a", "old-b"]
        for rid in ("old-a", "old-b"):
            entry = d.get(rid)
            assert entry.state == TransferState.FAILED and f"restarted (now epoch {new})" in entry.reason
        assert d.get("old-consumed").state == TransferState.CONSUMED
        assert d.get("other").state == TransferState.READY and d.get("new").state == TransferState.READY
        assert fail_earlier_incarnations(d, "bench-prefill", new) == []  # nothing left to fail
    finally:
        d.close()


def test_a_restarted_prefill_connector_fails_the_entries_it_left(redis_url):
    """The whole path: a producer built for a node id whose earlier incarnation left a READY entry (the steps
    of `open_producer`, taken one by one)."""
    d = KVDirectory(redis_url)
    transport = producer = None
    try:
        _ready(d, "left-behind", "prefill-restart", d.next_epoch("prefill-restart"))
        config = peer.config(ConnectorKind.TCP, NodeRole.PREFILL, "prefill-restart", redis_url, 5.0)
        epoch = d.next_epoch(config.node_id)
        transport = create_transport(config, epoch)
        pool = transport.producer_pool(peer.layout(), 4, "cpu")
        assert d.get("left-behind").state == TransferState.READY  # no producer serves the pool yet
        producer = KVProducer(config, d, epoch, transport, KVRegion.from_kv_caches(pool.kv_caches))
        assert d.get("left-behind").state == TransferState.FAILED
    finally:
        if producer is not None:
            producer.close()  # closes its transport too
        elif transport is not None:
            transport.close()
        d.close()


def test_fencing_survives_redis_losing_its_data(redis_url):
    """FLUSHALL (or a restart without persistence) loses the epoch counters: the live node's next heartbeat
    puts its epoch back, so a restarted incarnation still draws a higher one and fences the old one off."""
    import redis

    from kvwire.connectors.wire import NodeInfo

    d = KVDirectory(redis_url, namespace="flush-test")
    client = redis.Redis.from_url(redis_url)
    try:
        for _ in range(3):
            old = d.next_epoch("p")
        info = NodeInfo(node_id="p", role=NodeRole.PREFILL, epoch=old, work_endpoint="tcp://127.0.0.1:1",
                        connector=ConnectorKind.TCP, free_blocks=1, total_blocks=1)
        d.register_node(info)
        client.flushall()
        d.heartbeat(info)  # the live incarnation re-registers within one beat
        assert d.get_node("p").epoch == old
        new = d.next_epoch("p")
        assert new == old + 1
        with pytest.raises(StaleNodeError):
            d.heartbeat(info)  # the old incarnation, resumed, is fenced off ...
        with pytest.raises(StaleNodeError):
            d.publish_ready(msgspec.structs.replace(_location("r"), producer="p", producer_epoch=old))  # ... and its KV
    finally:
        client.close()
        d.close()
