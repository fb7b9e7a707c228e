"""A consumer gives up the KV of a producer that restarted or died at once, not at its deadline
(real redis-server)."""

from __future__ import annotations

import time

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.connectors.consumer.producer_watch import ProducerWatch
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import NodeInfo


def _register(d: KVDirectory, node: str, epoch: int) -> None:
    d.register_node(NodeInfo(node_id=node, role=NodeRole.PREFILL, epoch=epoch, work_endpoint="tcp://127.0.0.1:1",
                             connector=ConnectorKind.TCP, free_blocks=1, total_blocks=1))


def _record(rid: str, producer: str, epoch: int) -> ExpectedKV:
    return ExpectedKV(rid, producer, time.monotonic() + 60, watched=True, producer_epoch=epoch)


def test_restarted_or_dead_producers_kv_is_given_up(redis_url):
    d = KVDirectory(redis_url, namespace="watch-test", node_ttl_s=5.0)
    try:
        e1 = d.next_epoch("p")
        _register(d, "p", e1)
        records = {r.request_id: r for r in (_record("a", "p", e1), _record("b", "gone", 7),
                                             _record("unknown-epoch", "p", 0))}
        given: list[str] = []
        watch = ProducerWatch(d, lambda: list(records.values()), given.append, absent_grace_s=0.3)
        assert watch.check() == [] and not any(r.settled for r in records.values())  # "gone" just went missing
        e2 = d.next_epoch("p")
        _register(d, "p", e2)  # p restarted: what its first incarnation was sent is never coming
        time.sleep(0.35)
        assert sorted(watch.check()) == ["a", "b"] and sorted(given) == ["a", "b"]
        assert "restarted (epoch 1 -> 2)" in records["a"].failure
        assert "is gone" in records["b"].failure
        assert not records["unknown-epoch"].settled  # no epoch: waits for the directory or its deadline
        fresh = _record("c", "p", e2)
        records["c"] = fresh
        assert watch.check() == [] and not fresh.settled  # the live incarnation's own requests are left alone
    finally:
        d.close()
