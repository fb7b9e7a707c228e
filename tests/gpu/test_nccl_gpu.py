"""The NCCL connector on CUDA tensors: a producer process on cuda:0, the consumer on cuda:1.

Here the pair groups are NCCL communicators (the CPU tests exercise the same code over
Gloo). They skip where fewer than two CUDA devices exist; NCCL cannot put both ranks
of one communicator on one device, so there is no single-GPU variant.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import ConsumerSide, open_consumer
from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wire import DType
from tests.connectors import peer

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CTX = mp.get_context("spawn")
NCCL = ConnectorKind.NCCL
pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"NCCL needs its two ranks on two CUDA devices, found {GPUS}")


def _producer(redis_url, lay, requests, *, intermediate=False, deadline_s=10.0):
    results = CTX.Queue()
    proc = CTX.Process(target=peer.produce, args=(redis_url, NCCL, lay, requests, intermediate, deadline_s, results),
                       kwargs={"device": "cuda:0"})
    proc.start()
    assert results.get(timeout=120) == ("published", len(requests))
    return proc, results


def _consumer(redis_url, lay, deadline_s=10.0) -> tuple[ConsumerSide, KVPool]:
    pool = KVPool.allocate(lay, 64, "cuda:1")
    side = open_consumer(peer.config(NCCL, NodeRole.DECODE, "decode-gpu", redis_url, deadline_s),
                         kv_caches=pool.kv_caches)
    return side, pool


def _recv(side: ConsumerSide, pool: KVPool, batch):
    mi = ModelInput([SequenceInput(rid, [0] * t, 0, dst) for rid, t, _, dst in batch])
    hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
    return hidden, bypass, mi


@two_gpus
@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16])
def test_round_trip_cuda0_to_cuda1(redis_url, dtype):
    lay = peer.layout(dtype, layers=8, block_size=16)
    reqs = [("g0", 1, [3], [40]), ("g1", 16, [7], [12]), ("g2", 33, [0, 1, 9], [20, 21, 5]),
            ("g3", 79, [10, 11, 12, 13, 30], [50, 51, 52, 53, 2])]
    proc, results = _producer(redis_url, lay, [(rid, t, src) for rid, t, src, _ in reqs])
    side, pool = _consumer(redis_url, lay)
    try:
        for batch in (reqs[:1], reqs[1:]):  # the second batch reuses the pair built by the first
            hidden, bypass, mi = _recv(side, pool, batch)
            assert bypass and hidden.device == torch.device("cuda:1")
            for (rid, t, src, dst), rows in zip(batch, mi.token_slices()):
                assert torch.equal(pool.data[dst].cpu(), peer.request_kv(rid, lay, len(src)))
                assert peer.received_as_sent(hidden[rows], rid, t)
        assert len(side.consumer._puller._links) == 1  # test-only: one NCCL pair, reused
        assert results.get(timeout=60) == ("released", {rid: src for rid, _, src, _ in reqs})
    finally:
        side.close()
        proc.join(30)
        proc.kill()


@two_gpus
def test_intermediate_tensors_on_cuda(redis_url):
    lay = peer.layout(DType.BFLOAT16, layers=4, block_size=4)
    proc, _ = _producer(redis_url, lay, [("i0", 5, [1, 2])], intermediate=True)
    side, pool = _consumer(redis_url, lay)
    try:
        hidden, bypass, _ = _recv(side, pool, [("i0", 5, [1, 2], [8, 9])])
        assert bypass and isinstance(hidden, IntermediateTensors)
        want = peer.request_hidden("i0", 5, True)
        assert IntermediateTensors({k: v.cpu() for k, v in hidden.items()}) == want
    finally:
        side.close()
        proc.join(30)
        proc.kill()


@two_gpus
def test_dead_producer_is_recomputed_and_its_successor_paired(redis_url):
    lay = peer.layout(DType.FLOAT16, layers=4, block_size=16)
    deadline_s = 5.0
    proc, _ = _producer(redis_url, lay, [("a", 16, [0]), ("orphan", 16, [1])], deadline_s=deadline_s)
    side, pool = _consumer(redis_url, lay, deadline_s=deadline_s)
    try:
        assert _recv(side, pool, [("a", 16, [0], [10])])[1]
        proc.kill()
        proc.join(10)
        start = time.monotonic()
        assert _recv(side, pool, [("orphan", 16, [1], [11])])[1] is False  # NCCL pair discarded, not hung
        assert time.monotonic() - start < deadline_s + 2.0
        proc, results = _producer(redis_url, lay, [("b", 16, [2])], deadline_s=deadline_s)
        hidden, bypass, _ = _recv(side, pool, [("b", 16, [2], [12])])
        assert bypass and torch.equal(pool.data[[12]].cpu(), peer.request_kv("b", lay, 1))
        assert results.get(timeout=60) == ("released", {"b": [2]})
    finally:
        side.close()
        proc.kill()


def test_both_ranks_on_one_gpu():
    pytest.skip("NCCL does not allow two ranks of one communicator on one CUDA device "
                "(use the shm or ucx connector for single-GPU disaggregation)")
