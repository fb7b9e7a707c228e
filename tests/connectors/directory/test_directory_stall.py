"""A directory that stops answering for a while (Redis stalled: SIGSTOP here, a failover or a frozen host in
production) costs a consumer no recompute as long as it answers again within the request's deadline."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from kvwire.cluster.redis_server import LocalRedis
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory import directory as directory_module
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.vllm.layout import region_of

TIMEOUT_S = 0.5  # the directory's socket timeouts here (5 s and 10 s in production): a stall outlasts them
STALL_S = 1.5  # past both: 0.5 s for a command, 0.5 + 0.5 s for a blocking read


def _region(fill: float):
    tensors = {f"layer.{i}": torch.full((8, 2, 4, 16), fill) for i in range(2)}  # [blocks, heads, tokens, 2*dim]
    return tensors, region_of(tensors, 8, 4)


def test_a_watch_outlives_a_directory_stall_shorter_than_the_deadline(monkeypatch):
    monkeypatch.setattr(directory_module, "_BLOCK_SLICE_S", TIMEOUT_S)
    with LocalRedis() as redis:
        def config(role: NodeRole, node: str) -> ConnectorConfig:
            return ConnectorConfig(kind=ConnectorKind.TCP, role=role, node_id=node, redis_url=redis.url,
                                   kv_deadline_s=30.0)

        directories = [KVDirectory(redis.url, command_timeout_s=TIMEOUT_S) for _ in range(2)]
        _, src = _region(7.0)
        dst_tensors, dst = _region(0.0)
        prod_config, cons_config = config(NodeRole.PREFILL, "prefill"), config(NodeRole.DECODE, "decode")
        producer = KVProducer(prod_config, directories[0], 1, create_transport(prod_config, 1), src)
        consumer = KVConsumer(cons_config, directories[1], create_transport(cons_config, 1), dst)
        try:
            consumer.expect("r", "prefill")  # its watcher waits on the directory from now on
            time.sleep(0.3)
            assert redis.pid is not None
            os.kill(redis.pid, signal.SIGSTOP)
            threading.Timer(STALL_S, os.kill, (redis.pid, signal.SIGCONT)).start()
            time.sleep(STALL_S + 0.5)
            producer.hold("r", [1, 2], 8)
            got = consumer.receive_blocks("r", 8, [3, 4])
        finally:
            os.kill(redis.pid, signal.SIGCONT)
            consumer.close()
            producer.close()
            for d in directories:
                d.close()
    assert got.kv_bytes == 2 * 2 * 2 * 4 * 16 * 4
    assert all(bool((t[[3, 4]] == 7.0).all()) for t in dst_tensors.values())
