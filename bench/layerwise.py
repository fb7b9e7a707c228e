"""`kvwire bench transfer --layerwise`: how much of the KV transfer hides behind prefill's compute.

The nodes' own path: two processes, each with a connector that streams layers (tcp or
ucx; the producer's with `layerwise`), and a real redis-server. One trial:

1. The producer opens the request's layer stream (`begin_layer_stream`: published before
   the forward).
2. It "computes" each layer for `compute_ms` (a sleep: on an accelerator the CPU is free
   while a layer runs) and hands it over (`on_layer`, as the model's forward does);
   meanwhile the bench process pulls it with `recv_kv_caches_and_hidden_states`.
3. It completes the stream with the hidden states.

First, with every layer handed over before the pull starts, the whole transfer (and one
layer's share of it); then with compute. The figure that matters: the time from the
producer's last layer to the consumer holding every layer and the hidden states, against
one layer's transfer.
"""

from __future__ import annotations

import statistics
import time

import msgspec
import torch

from kvwire.bench.connector_run import bench_config, bench_pool, request_input
from kvwire.bench.procs import helper_context
from kvwire.bench.workload import Workload, checksum, fill_random, zero_blocks
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.standalone import open_consumer, open_producer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.engine.gc_pauses import freeze_startup_heap


class LayerwiseResult(msgspec.Struct, frozen=True):
    method: str  # the connector: tcp or ucx
    tokens: int
    pool: str
    layers: int
    transfer_ms: float  # whole request, every layer ready before the pull, median
    layer_transfer_ms: float  # transfer_ms / layers
    compute_ms_per_layer: float
    prefill_ms: float  # layers x compute
    tail_ms: float  # producer's last layer done -> consumer holds every layer, median
    tail_over_layer: float  # target <= 1.5
    hidden_fraction: float  # 1 - tail / transfer: the share of the transfer hidden behind compute
    verified: bool


def _producer(work: Workload, kind: ConnectorKind, redis_url: str, pipe) -> None:
    """Per trial: (request id, compute seconds per layer, wait for the go-ahead before the last handover)."""
    torch.set_num_threads(1)
    side = open_producer(bench_config(kind, NodeRole.PREFILL, redis_url, layerwise=True), **bench_pool(work))
    conn, kv_caches, region = side.connector, side.kv_caches, KVRegion.from_kv_caches(side.kv_caches)
    fill_random(region)
    hidden = work.hidden()
    freeze_startup_heap()  # as a node does once it has started
    pipe.send(checksum(region, work.block_ids(0)))
    while (trial := pipe.recv()) is not None:
        rid, compute_s = trial
        batch = request_input(work, rid, 0)
        on_layer = conn.begin_layer_stream(batch, work.hidden_width, hidden.dtype)
        assert on_layer is not None, "a layer-wise producer streams"
        for layer in range(work.layout.num_layers):
            if compute_s:
                time.sleep(compute_s)
            on_layer(layer)
        last = time.monotonic()
        conn.send_kv_caches_and_hidden_states(None, batch, kv_caches, hidden)
        pipe.send(last)
    side.close()


def _trials(work: Workload, compute_s: float, n: int, tag: str, pipe, conn, kv_caches,
            region) -> tuple[list[float], bool]:
    """Seconds of each pull (compute 0: started once every layer is handed over) or of each tail (after the
    producer's last layer); and whether every trial's bytes matched."""
    ok, out = True, []
    for i in range(n):
        zero_blocks(region, work.block_ids(1))
        rid = f"bench-layerwise-{work.tokens}-{work.pool}-{tag}-{i}"
        pipe.send((rid, compute_s))
        last = pipe.recv() if not compute_s else None  # back to back: every layer is in before the pull
        start = time.monotonic()
        hidden, bypass, _ = conn.recv_kv_caches_and_hidden_states(None, request_input(work, rid, 1), kv_caches)
        ready = time.monotonic()
        if last is None:
            last = pipe.recv()
        out.append(ready - start if not compute_s else ready - last)
        ok &= bypass and work.hidden_received(hidden)
    return out, ok


def bench_layerwise(work: Workload, kind: ConnectorKind, runs: int, warmup: int, compute_ms: float | None,
                    redis_url: str) -> LayerwiseResult:
    """compute_ms None: one layer's measured transfer time (compute just covers transfer)."""
    ctx = helper_context()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(work, kind, redis_url, there), daemon=True)
    proc.start()
    side = open_consumer(bench_config(kind, NodeRole.DECODE, redis_url), **bench_pool(work))
    try:
        want = here.recv()
        kv_caches, region = side.kv_caches, KVRegion.from_kv_caches(side.kv_caches)
        freeze_startup_heap()
        args = (here, side.connector, kv_caches, region)
        _trials(work, 0.0, warmup, "warm", *args)
        totals, ok_whole = _trials(work, 0.0, runs, "whole", *args)
        transfer = statistics.median(totals)
        per_layer = transfer / work.layout.num_layers
        compute_s = per_layer if compute_ms is None else compute_ms / 1e3
        tails, ok_streamed = _trials(work, compute_s, runs, "streamed", *args)
        verified = ok_whole and ok_streamed and checksum(region, work.block_ids(1)) == want
        here.send(None)
    finally:
        side.close()
        proc.join(30)
        proc.kill()
    tail = statistics.median(tails)
    return LayerwiseResult(
        method=str(kind), tokens=work.tokens, pool=str(work.pool), layers=work.layout.num_layers,
        transfer_ms=round(transfer * 1e3, 2), layer_transfer_ms=round(per_layer * 1e3, 3),
        compute_ms_per_layer=round(compute_s * 1e3, 3), prefill_ms=round(compute_s * 1e3 * work.layout.num_layers, 2),
        tail_ms=round(tail * 1e3, 3),
        tail_over_layer=round(tail / per_layer, 2), hidden_fraction=round(1 - tail / transfer, 3), verified=verified)
