"""One conformance suite for every connector, between two real processes and a real redis-server.

Run one connector's part with `pytest tests/connectors/test_conformance.py --connector tcp`.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.hidden import INLINE_MAX
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import ConsumerSide, open_consumer
from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wire import DType
from tests import procs
from tests.connectors import peer

CTX = procs.CTX


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _consumer(kind: ConnectorKind, redis_url: str, lay, num_blocks: int = 64, deadline_s: float = 10.0,
              device: str = "cpu") -> tuple[ConsumerSide, KVPool]:
    pool = KVPool.allocate(lay, num_blocks, device)
    side = open_consumer(peer.config(kind, NodeRole.DECODE, "consumer-test", redis_url, deadline_s),
                         kv_caches=pool.kv_caches)
    return side, pool


def _producer(kind, redis_url, lay, requests, *, intermediate=False, deadline_s=10.0, num_blocks=64, die=False,
              device="cpu", hidden_width=peer.HIDDEN):
    results = CTX.Queue()
    proc = CTX.Process(target=peer.produce, args=(redis_url, kind, lay, requests, intermediate, deadline_s, results),
                       kwargs={"num_blocks": num_blocks, "die_mid_transfer": die, "device": device,
                               "hidden_width": hidden_width})
    proc.start()
    assert results.get(timeout=60) == ("published", len(requests))
    return proc, results


def _scattered(rng: random.Random, pool_blocks: int, counts: list[int]) -> list[list[int]]:
    ids = rng.sample(range(pool_blocks), sum(counts))
    out, i = [], 0
    for n in counts:
        out.append(ids[i:i + n])
        i += n
    return out


def _check(pool, lay, rid, dst, n_blocks, hidden, tokens, intermediate=False, width=peer.HIDDEN):
    assert torch.equal(pool.data[dst].cpu(), peer.request_kv(rid, lay, n_blocks)), f"KV of {rid} differs"
    if intermediate:
        assert hidden == peer.request_hidden(rid, tokens, intermediate, width)
    else:
        assert peer.received_as_sent(hidden, rid, tokens, width)


def _devices(kind: ConnectorKind, device: str) -> tuple[str, str]:
    """(producer, consumer) devices; CUDA runs skip where the GPUs are missing."""
    if device == "cpu":
        return "cpu", "cpu"
    if GPUS < 1:
        pytest.skip("no CUDA device: the CUDA run of the conformance suite needs one")
    if kind.value == "nccl":
        if GPUS < 2:
            pytest.skip("NCCL needs its two ranks on two CUDA devices")
        return "cuda:0", "cuda:1"
    return "cuda:0", f"cuda:{min(1, GPUS - 1)}"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # `.ci/gpu run` runs the gpu-marked ones


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, block_size, layers", [
    (DType.FLOAT32, 16, 1), (DType.FLOAT16, 1, 64), (DType.BFLOAT16, 64, 8), (DType.FLOAT32, 1, 3)])
def test_round_trip_is_byte_exact(connector_kind, redis_url, dtype, block_size, layers, device):
    producer_device, consumer_device = _devices(connector_kind, device)
    lay = peer.layout(dtype, layers, block_size)
    tokens = [1, block_size, 2 * block_size + 1, 5 * block_size - 1]
    counts = [-(-t // block_size) for t in tokens]
    rng = random.Random(7)
    src, dst = _scattered(rng, 64, counts), _scattered(rng, 64, counts)  # different ids on each side
    requests = [(f"r{i}-{t}", t, s) for i, (t, s) in enumerate(zip(tokens, src))]
    proc, results = _producer(connector_kind, redis_url, lay, requests, device=producer_device)
    side, pool = _consumer(connector_kind, redis_url, lay, device=consumer_device)
    try:
        for (rid, t, s), d in zip(requests, dst):
            mi = ModelInput([SequenceInput(rid, [0] * t, 0, d)])
            hidden, bypass, out = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
            assert bypass is True and out is mi
            _check(pool, lay, rid, d, len(s), hidden, t)
        assert results.get(timeout=30) == ("released", {r: s for r, _, s in requests})
        proc.join(30)
        assert proc.exitcode == 0
        assert KVDirectory(redis_url).request_ids() == []
    finally:
        side.close()
        proc.kill()


@pytest.mark.parametrize("device", DEVICES)
def test_many_in_flight_complete_out_of_order(connector_kind, redis_url, device):
    producer_device, consumer_device = _devices(connector_kind, device)
    lay = peer.layout(DType.BFLOAT16, 4, 4)
    rng = random.Random(3)
    counts = [rng.randint(1, 6) for _ in range(16)]
    src, dst = _scattered(rng, 128, counts), _scattered(rng, 128, counts)
    requests = [(f"req-{i}", 4 * n - rng.randint(0, 3), s) for i, (n, s) in enumerate(zip(counts, src))]
    proc, results = _producer(connector_kind, redis_url, lay, requests, num_blocks=128, device=producer_device)
    side, pool = _consumer(connector_kind, redis_url, lay, num_blocks=128, device=consumer_device)
    try:
        order = list(range(len(requests)))
        rng.shuffle(order)
        for batch in (order[i:i + 4] for i in range(0, len(order), 4)):
            mi = ModelInput([SequenceInput(requests[i][0], [0] * requests[i][1], 0, dst[i]) for i in batch])
            hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
            assert bypass
            for i, rows in zip(batch, mi.token_slices()):
                rid, t, s = requests[i]
                _check(pool, lay, rid, dst[i], len(s), hidden[rows], t)
        assert results.get(timeout=30)[1] == {r: s for r, _, s in requests}
    finally:
        side.close()
        proc.join(30)
        proc.kill()


@pytest.mark.parametrize("device", DEVICES)
def test_hidden_states_wider_than_the_kv_ready_arrive_whole(connector_kind, redis_url, device):
    """Hidden states whose last row (all that travels of them) passes INLINE_MAX, wider than any model kvwire runs:
    over shared memory they lie in the hold board's hidden area, beside a pool that is a memfd or, on CUDA, read by
    IPC."""
    producer_device, consumer_device = _devices(connector_kind, device)
    lay, width = peer.layout(DType.BFLOAT16, 2, 16), INLINE_MAX // 4 + 1  # float32: one row of 64 KiB + 4 bytes
    requests = [("wide-1", 40, [3, 9, 4]), ("wide-2", 9, [11])]
    proc, results = _producer(connector_kind, redis_url, lay, requests, device=producer_device, hidden_width=width)
    side, pool = _consumer(connector_kind, redis_url, lay, device=consumer_device)
    try:
        for (rid, tokens, src), dst in zip(requests, ([20, 21, 22], [30])):
            mi = ModelInput([SequenceInput(rid, [0] * tokens, 0, dst)])
            hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
            assert bypass is True
            _check(pool, lay, rid, dst, len(src), hidden, tokens, width=width)
        side.connector.after_step(idle=True)  # reads with no claim are told now: the producer releases
        assert results.get(timeout=30) == ("released", {r: s for r, _, s in requests})
    finally:
        side.close()
        proc.join(30)
        proc.kill()


def test_intermediate_tensors_travel_whole(connector_kind, redis_url):
    lay = peer.layout()
    requests = [("a", 5, [1, 2]), ("b", 3, [6])]
    proc, _ = _producer(connector_kind, redis_url, lay, requests, intermediate=True)
    side, pool = _consumer(connector_kind, redis_url, lay)
    try:
        mi = ModelInput([SequenceInput("a", [0] * 5, 0, [8, 9]), SequenceInput("b", [0] * 3, 0, [3])])
        hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        assert bypass and isinstance(hidden, IntermediateTensors)
        expected = [peer.request_hidden(r, n, True) for r, n, _ in requests]
        assert hidden == IntermediateTensors({k: torch.cat([e[k] for e in expected]) for k in expected[0].keys()})
        assert hidden["residual"].dtype == torch.bfloat16
    finally:
        side.close()
        proc.join(30)
        proc.kill()


def test_kv_that_never_comes_ends_at_the_deadline(connector_kind, redis_url):
    side, pool = _consumer(connector_kind, redis_url, peer.layout(), num_blocks=16, deadline_s=0.5)
    try:
        mi = ModelInput([SequenceInput("never-comes", [0] * 4, 0, [0])])
        start = time.monotonic()
        hidden, bypass, out = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        assert (hidden, bypass, out) == (None, False, mi)
        assert 0.45 <= time.monotonic() - start < 2.0
        assert KVDirectory(redis_url).get("never-comes").state == "failed"
    finally:
        side.close()


def test_sender_killed_mid_transfer_ends_in_recompute(connector_kind, redis_url):
    # 64 KiB blocks: big enough to still be moving. Over TCP, bytes the kernel holds still arrive after the
    # sender dies (whole and in order: such a pull rightly succeeds), so there 1 MiB blocks, 40 MiB in all,
    # outrun the socket buffers that the producer's first write fills.
    block_size = 256 if connector_kind == ConnectorKind.TCP else 16
    lay = peer.layout(DType.FLOAT32, 32, block_size)
    requests = [("doomed", block_size * 40, list(range(0, 80, 2)))]
    deadline_s = 2.0
    proc, _ = _producer(connector_kind, redis_url, lay, requests, deadline_s=deadline_s, num_blocks=80, die=True)
    side, pool = _consumer(connector_kind, redis_url, lay, num_blocks=80, deadline_s=deadline_s)
    try:
        mi = ModelInput([SequenceInput("doomed", [0] * (block_size * 40), 0, list(range(1, 80, 2)))])
        start = time.monotonic()
        hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        assert hidden is None and bypass is False
        assert time.monotonic() - start < deadline_s + 2.0
        proc.join(10)
        assert proc.exitcode == -9
    finally:
        side.close()
        proc.kill()


def test_a_failed_ucx_pull_fences_its_workers_and_the_next_pull_works(redis_url):
    """A receive UCX matched before the failure cannot be cancelled: the consumer drops those workers (a late
    write from the producer, once a cut link is back, has nowhere to land) and pulls on at a new address."""
    kind, lay = ConnectorKind.UCX, peer.layout(DType.FLOAT32, 32, 16)
    doomed = [("doomed", 16 * 40, list(range(0, 80, 2)))]
    proc, _ = _producer(kind, redis_url, lay, doomed, deadline_s=2.0, num_blocks=80, die=True)
    side, pool = _consumer(kind, redis_url, lay, num_blocks=80, deadline_s=2.0)
    directory = KVDirectory(redis_url)
    try:
        before = directory.transport_address_of("consumer-test", ConnectorKind.UCX)
        mi = ModelInput([SequenceInput("doomed", [0] * (16 * 40), 0, list(range(1, 80, 2)))])
        assert side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)[1] is False
        proc.join(10)
        fine = [("fine", 16 * 3, [5, 6, 7])]
        proc, _ = _producer(kind, redis_url, lay, fine, deadline_s=10.0, num_blocks=80)
        mi = ModelInput([SequenceInput("fine", [0] * (16 * 3), 0, [10, 20, 30])])
        hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, mi, pool.kv_caches)
        assert bypass is True
        _check(pool, lay, "fine", [10, 20, 30], 3, hidden, 16 * 3)
        assert directory.transport_address_of("consumer-test", ConnectorKind.UCX) not in (None, before)
    finally:
        directory.close()
        side.close()
        proc.kill()
