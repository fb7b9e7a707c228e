"""Redis losing its data under a held request (a restart without persistence, FLUSHALL): the producer's next
heartbeat finds its node gone, and the producer advertises the KV it still holds again, so the consumer
pulls it instead of recomputing at its deadline (real redis-server, real TCP transfer)."""

from __future__ import annotations

import time

import redis

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import TransferState
from kvwire.connectors.directory.heartbeat import Heartbeat
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import open_consumer, open_producer
from kvwire.connectors.wire import NodeInfo
from tests.connectors import peer

LAYOUT = peer.layout()
BLOCKS = 4
BEAT_S = 0.05


def _node(node_id: str, role: NodeRole, epoch: int) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, epoch=epoch, work_endpoint="tcp://127.0.0.1:1",
                    connector=ConnectorKind.TCP, free_blocks=1, total_blocks=1)


def _wait_ready(directory, rid: str, timeout_s: float = 5.0):
    """The entry once READY (the directory's own blocking wait on the entry's events)."""
    entry = directory.wait_for(rid, {TransferState.READY}, time.monotonic() + timeout_s)
    assert entry is not None and entry.state == TransferState.READY, f"{rid} not READY within {timeout_s} s: {entry}"
    return entry


def test_a_held_request_is_advertised_again_after_redis_lost_it(redis_url):
    producer = open_producer(peer.config(ConnectorKind.TCP, NodeRole.PREFILL, "loss-prefill", redis_url, 10.0),
                             layout=LAYOUT, num_blocks=BLOCKS)
    consumer = open_consumer(peer.config(ConnectorKind.TCP, NodeRole.DECODE, "loss-decode", redis_url, 3.0),
                             layout=LAYOUT, num_blocks=BLOCKS)
    client = redis.Redis.from_url(redis_url)
    beats: list[Heartbeat] = []
    try:
        tokens = LAYOUT.block_size * BLOCKS
        pool = peer.pool_of(producer.kv_caches)
        pool.data[list(range(BLOCKS))] = peer.request_kv("lost", LAYOUT, BLOCKS)
        seq = SequenceInput("lost", [0] * tokens, 0, list(range(BLOCKS)))
        producer.connector.send_kv_caches_and_hidden_states(None, ModelInput([seq]), producer.kv_caches,
                                                            peer.request_hidden("lost", tokens, False))
        epoch = _wait_ready(producer.directory, "lost").location.producer_epoch
        beats = [Heartbeat(producer.directory, lambda: _node("loss-prefill", NodeRole.PREFILL, epoch),
                           interval_s=BEAT_S, on_restored=producer.producer.readvertise),
                 Heartbeat(consumer.directory, lambda: _node("loss-decode", NodeRole.DECODE, 1),
                           interval_s=BEAT_S, on_beat=consumer.consumer.publish_addresses)]  # as the nodes run them
        for beat in beats:
            beat.start()
        client.flushall()  # the entry, the nodes' records, epochs and addresses go
        assert producer.directory.get("lost") is None
        _wait_ready(producer.directory, "lost")  # the next beat found the node gone: advertised again
        # and the consumer's next beat published its addresses again: until it has, the producer refuses its pulls
        # (an address it did not publish), and they recompute, counted (transport)
        deadline = time.monotonic() + 5.0
        while not producer.directory.transport_address_of("loss-decode", ConnectorKind.TCP):
            assert time.monotonic() < deadline, "the consumer's heartbeat did not publish its address again"
            time.sleep(BEAT_S / 5)
        _, bypass, _ = consumer.connector.recv_kv_caches_and_hidden_states(
            None, ModelInput([SequenceInput("lost", [0] * tokens, 0, list(range(BLOCKS)))]), consumer.kv_caches)
        assert bypass, "the request's KV was pulled, not recomputed"
        assert peer.pool_of(consumer.kv_caches).data[list(range(BLOCKS))].equal(pool.data[list(range(BLOCKS))])
    finally:
        for beat in beats:
            beat.stop()
        client.close()
        consumer.close()
        producer.close()
