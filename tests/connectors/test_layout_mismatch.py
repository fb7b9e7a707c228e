"""A consumer whose pool differs from the producer's (dtype, layers, block size, heads, pool layout) refuses
the KV and recomputes; nothing moves, and the producer's blocks are released by its hold deadline."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvwire.bench.choices import Placement
from kvwire.bench.workload import Workload, allocate_pool
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import open_consumer, open_producer
from kvwire.connectors.wire import DType, PoolLayout
from tests.connectors import peer

BASE = peer.layout(DType.FLOAT32, layers=3, block_size=4)
VARIANTS = {
    "dtype": msgspec.structs.replace(BASE, dtype=DType.BFLOAT16),
    "layers": msgspec.structs.replace(BASE, num_layers=4),
    "block_size": msgspec.structs.replace(BASE, block_size=8),
    "heads": msgspec.structs.replace(BASE, num_kv_heads=4),
    "pool_layout": msgspec.structs.replace(BASE, pool=PoolLayout.VLLM),
}


def _caches(layout):
    if layout.pool == PoolLayout.VLLM:
        return allocate_pool(Workload(16, Placement.CONTIGUOUS, PoolLayout.VLLM, layout=layout))
    return KVPool.allocate(layout, 16, "cpu").kv_caches


@pytest.mark.parametrize("what", list(VARIANTS))
def test_mismatched_layout_recomputes(redis_url, what):
    pk, ck = _caches(BASE), _caches(VARIANTS[what])
    prod = open_producer(peer.config(ConnectorKind.TCP, NodeRole.PREFILL, f"p-{what}", redis_url, 1.0),
                         kv_caches=pk)
    cons = open_consumer(peer.config(ConnectorKind.TCP, NodeRole.DECODE, f"c-{what}", redis_url, 1.0), kv_caches=ck)
    rid = f"mismatch-{what}"
    try:
        tokens = 8
        prod.connector.send_kv_caches_and_hidden_states(
            None, ModelInput([SequenceInput(rid, [1] * tokens, 0, [0, 1])]), pk, torch.zeros(tokens, 4))
        before = [c.clone() for c in ck]
        _, bypass, _ = cons.connector.recv_kv_caches_and_hidden_states(
            None, ModelInput([SequenceInput(rid, [1] * tokens, 0, [2, 3])]), ck)
        assert not bypass
        assert all(torch.equal(a, b) for a, b in zip(before, ck))  # nothing landed
    finally:
        cons.close()
        prod.close()
    # closing (or the hold deadline) released the producer's blocks
    assert [tuple(r) for r in prod.producer.released()] == [(rid, [0, 1])]
