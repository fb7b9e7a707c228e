"""Layer-wise streaming: each layer lands in the right blocks, in order; a wrong header is refused."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from bench.workload import Placement, Workload, allocate_pool, checksum, fill_random, zero_blocks
from connectors.kv_region import KVRegion
from connectors.layerwise import LayerReceiver, LayerSender, LayerStreamError, layer_pieces
from connectors.wire import DType, KVLayout, PoolLayout

SMALL = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=DType.BFLOAT16)


@pytest.mark.parametrize("pool", list(PoolLayout))
def test_layer_pieces_cover_exactly_that_layer(pool):
    work = Workload(12, Placement.SCATTERED, pool, layout=SMALL)
    region = KVRegion.from_kv_caches(kv := allocate_pool(work))
    blocks = work.block_ids(0)
    for layer in range(SMALL.num_layers):
        for p in layer_pieces(region, blocks, layer):
            p.view(torch.bfloat16).fill_(layer + 1)
    for layer in range(SMALL.num_layers):  # the per-layer views the engine uses see only their layer's value
        view = kv[layer][:, blocks] if pool == PoolLayout.VLLM else kv[layer][blocks]
        assert view.eq(layer + 1).all()
    total = sum(p.numel() for layer in range(SMALL.num_layers) for p in layer_pieces(region, blocks, layer))
    assert total == len(blocks) * region.block_nbytes


@pytest.mark.parametrize("pool", list(PoolLayout))
def test_layers_stream_between_different_blocks(pool):
    work = Workload(40, Placement.SCATTERED, pool, layout=SMALL)
    src, dst = (KVRegion.from_kv_caches(allocate_pool(work)) for _ in range(2))
    fill_random(src)
    zero_blocks(dst, work.block_ids(1))
    a, b = socket.socketpair()
    with a, b:
        sender = LayerSender(a, src, work.block_ids(0), "consumer")
        receiving = threading.Thread(target=LayerReceiver(b, dst, work.block_ids(1), "producer").receive_all)
        receiving.start()
        for layer in range(SMALL.num_layers):
            sender.layer_done(layer)
        sender.finish(10)
        receiving.join(10)
    assert checksum(src, work.block_ids(0)) == checksum(dst, work.block_ids(1))


def test_a_header_for_the_wrong_layer_is_refused_before_any_write():
    work = Workload(8, Placement.CONTIGUOUS, layout=SMALL)
    dst = KVRegion.from_kv_caches(allocate_pool(work))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("<4sIQ", b"KVL1", 1, 10**6) + b"\xff" * 64)  # layer 1 first, wrong size
        with pytest.raises(LayerStreamError, match="expected layer 0"):
            LayerReceiver(b, dst, work.block_ids(1), "producer").receive_all()
    assert all(p.eq(0).all() for p in dst.planes)
