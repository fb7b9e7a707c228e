"""A connector moving the benchmark's work between two real processes.

The producer process owns a prefill-role connector over a pool filled with random
bytes. One trial:

1. The bench process expects the request (as a decode node does when its `DecodeWork`
   arrives) and asks the producer to publish it; the producer tells it where the KV is
   directly (`KVReady` on a zmq socket of the bench's, as to a decode node's work socket).
2. It times its own decode-role connector's `recv_kv_caches_and_hidden_states`, from the
   call to the moment the blocks hold every byte and the connector says so: a decode
   node's hot path, with no directory round trip in it. Then `after_step`, untimed, as a
   node calls it once the first token is out (shared memory's read notes go then).
3. It checks the received blocks' crc32 against the producer's.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping

import torch
import zmq

from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.memory import PeakTracker
from kvwire.bench.procs import apply_env, child_env, helper_context
from kvwire.bench.workload import Workload, allocate_pool, checksum, fill_random, zero_blocks
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.control.framing import unpack
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import open_consumer, open_producer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import KVReady, PoolLayout
from kvwire.engine.gc_pauses import freeze_startup_heap

MEASURE = "!measure"  # tells the producer the measured trials start (not a request id: those start "bench-")


def bench_config(kind: ConnectorKind, role: NodeRole, redis_url: str, layerwise: bool = False) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=role, node_id=f"bench-{role}", redis_url=redis_url,
                           kv_deadline_s=120.0, entry_ttl_s=240.0, layerwise=layerwise)


def request_input(work: Workload, rid: str, side: int, consumer_endpoint: str = "") -> ModelInput:
    return ModelInput([SequenceInput(rid, [0] * work.tokens, 0, work.block_ids(side),
                                     consumer_endpoint=consumer_endpoint)])


def bench_pool(work: Workload) -> dict:
    """kvwire's pool comes from the transport (shm places a producer's in shared memory); vLLM's the bench
    allocates. Returns open_producer / open_consumer's pool arguments."""
    if work.pool == PoolLayout.KVWIRE:
        return {"layout": work.layout, "num_blocks": work.pool_blocks, "device": str(work.device)}
    return {"kv_caches": allocate_pool(work)}


def _producer(kind: ConnectorKind, redis_url: str, work: Workload, pipe, consumer_endpoint: str = "",
              env: Mapping[str, str | None] | None = None) -> None:
    apply_env(env or {})  # before the connector loads UCX: the fork server's environment is not the bench's now
    torch.set_num_threads(1)
    side = open_producer(bench_config(kind, NodeRole.PREFILL, redis_url), **bench_pool(work))
    region = KVRegion.from_kv_caches(side.kv_caches)
    fill_random(region)
    hidden = work.hidden().to(str(work.device))
    freeze_startup_heap()  # as a node does once it has started
    pipe.send(checksum(region, work.block_ids(0)))
    peak = PeakTracker()
    while (rid := pipe.recv()) is not None:
        if rid == MEASURE:
            peak.start()
            continue
        side.connector.send_kv_caches_and_hidden_states(None, request_input(work, rid, 0, consumer_endpoint),
                                                        side.kv_caches, hidden)
        pipe.send(rid)
    pipe.send(peak.extra_bytes())
    side.close()


@contextlib.contextmanager
def scoped_env(extra: Mapping[str, str | None]):
    """os.environ with `extra` applied (None: unset) for the block: this process's own UCX reads it then."""
    saved = {k: os.environ.get(k) for k in extra}
    apply_env(extra)
    try:
        yield
    finally:
        apply_env(saved)


def run_connector(kind: ConnectorKind, work: Workload, runs: int, warmup: int, redis_url: str,
                  env: dict[str, str] | None = None) -> tuple[list[float], bool, int, CpuTicks]:
    """Seconds of each measured trial, whether every trial's bytes matched, the peak memory either
    process used during the measured trials beyond what it held before them (pools included there),
    and the host's CPU ticks inside the measured trials."""
    ctx = helper_context()
    ready: zmq.Socket = zmq.Context.instance().socket(zmq.PULL)  # the KVReady a decode node's work socket gets
    ready.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{ready.bind_to_random_port('tcp://127.0.0.1')}"
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(kind, redis_url, work, there, endpoint, child_env(env)))
    proc.start()
    with scoped_env(env or {}):  # the consumer is this process
        side = open_consumer(bench_config(kind, NodeRole.DECODE, redis_url), **bench_pool(work))
    try:
        want = here.recv() if here.poll(120) else None
        kv_caches, region = side.kv_caches, KVRegion.from_kv_caches(side.kv_caches)
        freeze_startup_heap()
        dst = work.block_ids(1)
        times, verified, peak, cpu = [], want is not None, PeakTracker(), CpuTally()
        for i in range(warmup + runs):
            if i == warmup:
                here.send(MEASURE)
                peak.start()
            zero_blocks(region, dst)
            rid = f"bench-{kind}-{work.tokens}-{work.placement}-{work.pool}-{i}"
            side.consumer.expect(rid, producer=bench_config(kind, NodeRole.PREFILL, redis_url).node_id)
            here.send(rid)
            assert here.poll(120) and here.recv() == rid, "producer did not publish"
            _take_kv_ready(side, ready, rid)
            model_input = request_input(work, rid, 1)  # the node has it before it asks: not the transfer's time
            with cpu.counting(i >= warmup):
                start = time.perf_counter()
                hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, model_input, kv_caches)
                elapsed = time.perf_counter() - start
            side.connector.after_step(idle=True)  # as an idle node does once the request's first token is out
            verified &= bypass and checksum(region, dst) == want and work.hidden_received(hidden)
            if i >= warmup:
                times.append(elapsed)
        here.send(None)
        extra = max(peak.extra_bytes(), here.recv() if here.poll(60) else 0)
        return times, verified, extra, cpu.ticks
    finally:
        side.close()
        ready.close(0)
        proc.join(30)
        proc.kill()


def _take_kv_ready(side, ready: zmq.Socket, rid: str) -> None:
    """The producer's KVReady for `rid`, handed to the consumer as a decode node does."""
    assert ready.poll(120_000), f"no KVReady for {rid}"
    msg = unpack(ready.recv(), expect=KVReady)
    assert isinstance(msg, KVReady) and msg.location.request_id == rid, msg
    side.consumer.take_kv_ready(msg.location)
