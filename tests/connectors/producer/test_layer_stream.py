"""Layer-wise streaming through the real connector: a producer process that hands over one layer at a time,
a consumer pulling over TCP or UCX while the layers are still being computed, and a real redis-server."""

from __future__ import annotations

import time

import pytest
import torch

from kvwire.bench.choices import Placement
from kvwire.bench.workload import Workload, allocate_pool
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.producer.layer_gate import LayerGate
from kvwire.connectors.standalone import ConsumerSide, open_consumer, open_producer
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.wire import DType, KVLayout, PoolLayout
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
SMALL = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=DType.BFLOAT16)
LAYER_S = 0.05  # the producer's "compute" per layer


def _config(role: NodeRole, node_id: str, redis_url: str, layerwise: bool,
            kind: ConnectorKind = ConnectorKind.TCP) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=node_id, redis_url=redis_url,
                           kv_deadline_s=10.0, layerwise=layerwise)


def _stream(redis_url: str, kind: ConnectorKind, rid: str, tokens: int, blocks: list[int], fail_after: int | None,
            results) -> None:
    """Publish `rid` layer-wise; write each layer's KV only just before handing that layer over."""
    lay = peer.layout(layers=4, block_size=4)
    side = open_producer(_config(NodeRole.PREFILL, "producer-lw", redis_url, True, kind), layout=lay, num_blocks=64)
    conn, pool = side.connector, peer.pool_of(side.kv_caches)
    batch = ModelInput([SequenceInput(rid, [0] * tokens, 0, blocks)])
    kv = peer.request_kv(rid, lay, len(blocks))  # [blocks, layers, 2, block_size, heads, head_dim]
    on_layer = conn.begin_layer_stream(batch, peer.HIDDEN, torch.float32)
    results.put(("published", time.monotonic()))
    for layer in range(lay.num_layers):
        time.sleep(LAYER_S)
        if fail_after is not None and layer == fail_after:
            conn.abort_layer_stream(batch, "forward failed (test)")
            break
        pool.data[blocks, layer] = kv[:, layer]
        on_layer(layer)
    else:
        results.put(("last layer", time.monotonic()))
        conn.send_kv_caches_and_hidden_states(None, batch, side.kv_caches, peer.request_hidden(rid, tokens, False))
    results.put(("released", rid in peer.wait_released(side.producer, 1, 30)))
    side.close()
    peer.flush_replies()


def _consumer(redis_url: str, kind: ConnectorKind, lay) -> tuple[ConsumerSide, KVPool]:
    """Made before the producer starts its forward: the pull must not wait for the consumer's start-up."""
    pool = KVPool.allocate(lay, 64, "cpu")
    side = open_consumer(_config(NodeRole.DECODE, "consumer-lw", redis_url, False, kind), kv_caches=pool.kv_caches)
    return side, pool


def _consume(side: ConsumerSide, pool: KVPool, rid: str, tokens: int, dst: list[int]):
    start = time.monotonic()
    hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(
        None, ModelInput([SequenceInput(rid, [0] * tokens, 0, dst)]), pool.kv_caches)
    return side, pool, hidden, bypass, start, time.monotonic()


def _results(q, n: int) -> dict:
    return dict(q.get(timeout=60) for _ in range(n))


KINDS = [ConnectorKind.TCP, ConnectorKind.UCX]


@pytest.mark.parametrize("kind", KINDS)
def test_layers_arrive_while_the_producer_computes(redis_url, kind):
    lay, rid, tokens = peer.layout(layers=4, block_size=4), f"lw-1-{kind}", 37
    src, dst = [3, 4, 9, 10, 11, 20, 21, 30, 31, 32], [40, 41, 5, 6, 7, 8, 50, 51, 52, 53]
    q = CTX.Queue()
    side, pool = _consumer(redis_url, kind, lay)
    proc = CTX.Process(target=_stream, args=(redis_url, kind, rid, tokens, src, None, q))
    proc.start()
    try:
        published = q.get(timeout=60)[1]
        side, pool, hidden, bypass, start, end = _consume(side, pool, rid, tokens, dst)
        got = _results(q, 2)
        assert bypass
        assert torch.equal(pool.data[dst], peer.request_kv(rid, lay, len(dst))), "a layer was sent before it was done"
        assert peer.received_as_sent(hidden, rid, tokens)
        assert start < got["last layer"], "the pull should begin while layers are still being computed"
        assert end - got["last layer"] < 2 * lay.num_layers * LAYER_S  # decode-ready soon after the last layer
        assert published < start and got["released"], "the producer releases the blocks once they are pulled"
    finally:
        side.close()
        proc.join(30)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_forward_ends_the_stream_and_the_consumer_recomputes(redis_url, kind):
    lay, rid, tokens = peer.layout(layers=4, block_size=4), f"lw-2-{kind}", 16
    q = CTX.Queue()
    side, pool = _consumer(redis_url, kind, lay)
    proc = CTX.Process(target=_stream, args=(redis_url, kind, rid, tokens, [1, 2, 3, 4], 2, q))
    proc.start()
    try:
        q.get(timeout=60)
        side, _, hidden, bypass, _, _ = _consume(side, pool, rid, tokens, [7, 8, 9, 10])
        assert not bypass and hidden is None
        assert _results(q, 1)["released"], "the failed request's blocks must be released"
    finally:
        side.close()
        proc.join(30)


@pytest.mark.parametrize("pool", [PoolLayout.KVWIRE, PoolLayout.VLLM])  # vLLM's others: test_vllm_layout.py
def test_layer_parts_cover_exactly_that_layer(pool):
    work = Workload(12, Placement.SCATTERED, pool, layout=SMALL)
    region = KVRegion.from_kv_caches(kv := allocate_pool(work))
    blocks = work.block_ids(0)
    runs = [(b, 1) for b in blocks]
    for layer in range(SMALL.num_layers):
        for p in region.layer_parts(runs, layer):
            torch.frombuffer(p, dtype=torch.uint8).view(torch.bfloat16).fill_(layer + 1)
    for layer in range(SMALL.num_layers):  # the per-layer views the engine uses see only their layer's value
        view = kv[layer][:, blocks] if pool == PoolLayout.VLLM else kv[layer][blocks]
        assert view.eq(layer + 1).all()
    total = sum(p.nbytes for layer in range(SMALL.num_layers) for p in region.layer_parts(runs, layer))
    assert total == len(blocks) * region.block_nbytes


@pytest.mark.parametrize("pool_layout", [PoolLayout.KVWIRE, PoolLayout.VLLM])
def test_layer_major_parts_are_the_layers_in_order(pool_layout):
    lay = peer.layout(layers=3, block_size=2)
    pool = KVPool.allocate(lay, 12, "cpu") if pool_layout == PoolLayout.KVWIRE else None
    caches = pool.kv_caches if pool else [torch.zeros(2, 12, 2, 2, 8) for _ in range(3)]
    region = KVRegion.from_kv_caches(caches)
    for plane in region.planes:
        plane.copy_(torch.randint(0, 255, plane.shape, dtype=torch.uint8))
    blocks = [2, 3, 4, 8, 1]
    runs = [(s, n) for s, _, n in plan_runs(blocks, blocks)]
    got = b"".join(bytes(p) for p in region.layer_major_parts(runs))
    # layer by layer, the engine's own per-layer view of those blocks (vLLM's: K rows, then V rows)
    per_layer = [caches[layer][:, blocks] if pool_layout == PoolLayout.VLLM else caches[layer][blocks]
                 for layer in range(3)]
    want = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in per_layer)
    assert got == want


def test_gate_opens_layer_by_layer_and_wakes():
    woke = []
    gate = LayerGate("r", 3, torch.device("cpu"))
    gate.add_waker(lambda: woke.append(gate.ready_layers()))
    assert gate.ready_layers() == 0 and not gate.complete_and_ready
    gate.layer_done(0)
    gate.layer_done(1)
    assert gate.ready_layers() == 2 and woke == [1, 2]
    with pytest.raises(AssertionError):
        gate.layer_done(0)  # layers come in order
    gate.layer_done(2)
    gate.complete()
    assert gate.complete_and_ready and gate.failure is None
    gate.fail("too late")
    assert gate.failure is None, "a complete gate stays complete"


def test_layerwise_needs_tcp_or_ucx_and_no_checksums():
    with pytest.raises(ValueError, match="tcp"):
        ConnectorConfig(kind=ConnectorKind.SHM, role=NodeRole.PREFILL, node_id="p", redis_url="redis://x",
                        layerwise=True)
    with pytest.raises(ValueError, match="verify_kv"):
        ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.PREFILL, node_id="p", redis_url="redis://x",
                        layerwise=True, verify_kv=True)


def test_a_layerwise_request_released_during_its_forward_is_never_published_again(redis_url):
    from kvwire.connectors.directory.directory import TransferState

    hold_s = 0.3  # the hold deadline passes mid-forward
    config = ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.PREFILL, node_id="p-lw", redis_url=redis_url,
                             kv_deadline_s=hold_s, layerwise=True)
    side = open_producer(config, layout=peer.layout(), num_blocks=8)
    sender, directory = side.producer, side.directory
    try:
        batch = ModelInput([SequenceInput("lw-gone", [0] * 5, 0, [2, 3])])
        on_layer = sender.begin_layers(batch, peer.HIDDEN, torch.float32)
        assert sender.holds("lw-gone") and directory.get("lw-gone").location.layerwise
        deadline = time.monotonic() + 5
        while sender.holds("lw-gone"):  # released at its hold deadline, mid-forward
            assert time.monotonic() < deadline, "the hold deadline did not release the request"
            time.sleep(0.02)
        released = [tuple(r) for r in sender.released()]
        assert released == [("lw-gone", [2, 3])]
        assert directory.get("lw-gone").state == TransferState.EXPIRED
        for layer in range(peer.layout().num_layers):
            on_layer(layer)
        sender.publish(batch, torch.zeros(5, peer.HIDDEN))
        assert sender.released() == [] and not sender.holds("lw-gone"), "released once"
        assert directory.get("lw-gone").state == TransferState.EXPIRED
    finally:
        side.close()
