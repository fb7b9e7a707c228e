"""`kvwire bench transfer --layerwise`: how much of the KV transfer hides behind prefill's compute.

Two processes over loopback TCP (`connectors/layerwise.py`). The producer "computes"
each layer for `compute_ms` (a sleep: on an accelerator the CPU is free while a layer
runs) and hands it to the layer sender, which streams it while the next layer computes.
First every layer is sent back to back with no compute (the whole transfer, and one
layer's share of it); then with compute. The figure that matters: the time from the
producer's last layer to the consumer holding every layer, against one layer's transfer.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time

import msgspec
import torch

from bench.workload import Workload, allocate_pool, checksum, fill_random, zero_blocks
from connectors.kv_region import KVRegion
from connectors.layerwise import LayerReceiver, LayerSender


class LayerwiseResult(msgspec.Struct, frozen=True):
    tokens: int
    pool: str
    layers: int
    transfer_ms: float  # whole request, layers back to back, median
    layer_transfer_ms: float  # transfer_ms / layers
    compute_ms_per_layer: float
    prefill_ms: float  # layers x compute
    tail_ms: float  # producer's last layer done -> consumer holds every layer, median
    tail_over_layer: float  # target <= 1.5
    hidden_fraction: float  # 1 - tail / transfer: the share of the transfer hidden behind compute
    verified: bool


def _producer(work: Workload, port: int, pipe) -> None:
    torch.set_num_threads(1)
    region = KVRegion.from_kv_caches(allocate_pool(work))
    fill_random(region)
    pipe.send(checksum(region, work.block_ids(0)))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (compute_s := pipe.recv()) is not None:
            sender = LayerSender(sock, region, work.block_ids(0), "consumer")
            for layer in range(work.layout.num_layers):
                if compute_s:
                    time.sleep(compute_s)
                sender.layer_done(layer)
            last = time.monotonic()
            sender.finish(120)
            pipe.send(last)


def _trials(work: Workload, compute_s: float, n: int, pipe, sock, region) -> tuple[list[float], list[float]]:
    totals, tails = [], []
    for _ in range(n):
        zero_blocks(region, work.block_ids(1))
        start = time.monotonic()
        pipe.send(compute_s)
        LayerReceiver(sock, region, work.block_ids(1), "producer").receive_all()
        ready = time.monotonic()
        last = pipe.recv()
        totals.append(ready - start)
        tails.append(ready - last)
    return totals, tails


def bench_layerwise(work: Workload, runs: int, warmup: int, compute_ms: float | None) -> LayerwiseResult:
    """compute_ms None: one layer's measured transfer time (compute just covers transfer)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    region = KVRegion.from_kv_caches(allocate_pool(work))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        proc = ctx.Process(target=_producer, args=(work, srv.getsockname()[1], there), daemon=True)
        proc.start()
        try:
            want = here.recv()
            sock, _ = srv.accept()
            with sock:
                _trials(work, 0.0, warmup, here, sock, region)
                totals, _ = _trials(work, 0.0, runs, here, sock, region)
                transfer = statistics.median(totals)
                per_layer = transfer / work.layout.num_layers
                compute_s = per_layer if compute_ms is None else compute_ms / 1e3
                _, tails = _trials(work, compute_s, runs, here, sock, region)
                verified = checksum(region, work.block_ids(1)) == want
            here.send(None)
        finally:
            proc.join(30)
            proc.kill()
    tail = statistics.median(tails)
    return LayerwiseResult(
        tokens=work.tokens, pool=str(work.pool), layers=work.layout.num_layers, transfer_ms=round(transfer * 1e3, 2),
        layer_transfer_ms=round(per_layer * 1e3, 3), compute_ms_per_layer=round(compute_s * 1e3, 3),
        prefill_ms=round(compute_s * 1e3 * work.layout.num_layers, 2), tail_ms=round(tail * 1e3, 3),
        tail_over_layer=round(tail / per_layer, 2), hidden_fraction=round(1 - tail / transfer, 3), verified=verified)
