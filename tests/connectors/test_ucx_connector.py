"""The UCX connector between two real processes, with a real redis-server."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from connectors.directory import KVDirectory
from connectors.factory import create_connector
from connectors.types import IntermediateTensors
from connectors.wire import DType
from engine.kv_cache import KVPool
from engine.model_input import ModelInput, SequenceInput
from tests.connectors import peer

CTX = mp.get_context("spawn")


def _consumer(redis_url: str, deadline_s: float = 10.0):
    config = ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="consumer-test",
                             redis_url=redis_url, kv_deadline_s=deadline_s)
    return create_connector(0, 0, config)


def _start_producer(redis_url, lay, requests, intermediate=False, deadline_s=10.0):
    results = CTX.Queue()
    proc = CTX.Process(target=peer.produce, args=(redis_url, lay, requests, intermediate, deadline_s, results))
    proc.start()
    assert results.get(timeout=60) == ("published", len(requests))
    return proc, results


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16])
def test_round_trip_scattered_blocks(redis_url, dtype):
    lay = peer.layout(dtype)
    # (request, tokens, producer blocks); consumer blocks differ and are scattered too
    requests = [("r-one-token", 1, [7]), ("r-exact", 8, [3, 4]), ("r-plus-one", 9, [10, 2, 11]),
                ("r-long", 40, list(range(20, 30)))]
    dst = {"r-one-token": [0], "r-exact": [9, 1], "r-plus-one": [5, 6, 12], "r-long": [40, 41, 42, 13, 14, 50, 51, 52, 53, 30]}
    proc, results = _start_producer(redis_url, lay, requests)
    conn = _consumer(redis_url)
    pool = KVPool.allocate(lay, 64)
    conn.register_kv_caches(pool.kv_caches)
    try:
        for rid, tokens, src in requests:
            mi = ModelInput([SequenceInput(rid, [0] * tokens, 0, dst[rid])])
            hidden, bypass, out_mi = conn.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
            assert bypass is True and out_mi is mi
            assert torch.equal(pool.data[dst[rid]], peer.request_kv(rid, lay, len(src)))
            assert torch.equal(hidden, peer.request_hidden(rid, tokens, False))
            assert conn.take_transfer_stats(rid).kv_bytes >= len(src) * pool.block_nbytes
        assert results.get(timeout=30) == ("released", sorted(r for r, _, _ in requests))
        proc.join(30)
        assert proc.exitcode == 0
        assert KVDirectory(redis_url).request_ids() == []  # consumed entries are deleted
    finally:
        conn.close()
        proc.kill()


def test_batch_with_intermediate_tensors(redis_url):
    lay = peer.layout()
    requests = [("a", 5, [1, 2]), ("b", 3, [6])]
    proc, results = _start_producer(redis_url, lay, requests, intermediate=True)
    conn = _consumer(redis_url)
    pool = KVPool.allocate(lay, 64)
    conn.register_kv_caches(pool.kv_caches)
    try:
        mi = ModelInput([SequenceInput("a", [0] * 5, 0, [8, 9]), SequenceInput("b", [0] * 3, 0, [3])])
        hidden, bypass, _ = conn.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        assert bypass
        assert isinstance(hidden, IntermediateTensors)
        expected = [peer.request_hidden(r, n, True) for r, n, _ in requests]
        assert hidden == IntermediateTensors({k: torch.cat([e[k] for e in expected]) for k in expected[0].keys()})
        assert hidden[0:5] == expected[0]
    finally:
        conn.close()
        proc.join(30)
        proc.kill()


def test_missing_kv_times_out_without_bypass(redis_url):
    lay = peer.layout()
    conn = _consumer(redis_url, deadline_s=0.5)
    pool = KVPool.allocate(lay, 16)
    conn.register_kv_caches(pool.kv_caches)
    try:
        mi = ModelInput([SequenceInput("never-comes", [0] * 4, 0, [0])])
        start = time.monotonic()
        hidden, bypass, out_mi = conn.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        elapsed = time.monotonic() - start
        assert (hidden, bypass, out_mi) == (None, False, mi)
        assert 0.45 <= elapsed < 2.0
        assert KVDirectory(redis_url).get("never-comes").state == "failed"
    finally:
        conn.close()
