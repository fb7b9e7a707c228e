"""`kvwire bench directory`: the directory's throughput and latency against a real redis-server.

One request's directory life, as the nodes live it:

1. The producer publishes READY with its location.
2. The consumer looks it up.
3. It moves READY -> CONSUMED (compare-and-set).
4. It deletes the entry.

Latency: that life for one request at a time, with the round trips the nodes make
(publish; lookup; compare-and-set and delete pipelined together, as the producer does
once a pull is confirmed), p50 / p99 over many requests, each followed by three bare
PINGs timed the same way: the machine's floor for those three round trips, at the same
moments (and one bare PING before each, the floor for one: interleaved, so that a busy
moment of the machine falls on all three series alike, not on one). Throughput: the
same four steps for `batch` requests at once, pipelined, counted as operations (4 per
request) per second.
"""

from __future__ import annotations

import statistics
import time

import msgspec

from kvwire.bench.workload import LLAMA3_8B
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.batch import DirectoryBatch
from kvwire.connectors.directory.directory import DirectoryEntry, KVDirectory, TransferState
from kvwire.connectors.wire import KVLocation

STEPS_PER_REQUEST = 4  # publish, lookup, state change, delete


class DirectoryResult(msgspec.Struct, frozen=True):
    requests: int
    batch: int
    ops_per_s: float  # pipelined
    requests_per_s: float  # pipelined
    roundtrip_p50_ms: float  # one request's four steps in the three round trips the nodes make
    roundtrip_p99_ms: float
    ping_p50_ms: float  # a bare PING from the same client: the machine's own floor for one round trip
    ping_p99_ms: float
    # three bare PINGs in a row, timed right after each measured life: the floor for its three round trips
    three_pings_p50_ms: float
    three_pings_p99_ms: float
    verified: bool  # every step did what the state machine says


def _location(rid: str) -> KVLocation:
    return KVLocation(request_id=rid, producer="bench-prefill", producer_epoch=1, kind=ConnectorKind.UCX,
                      side_channel="tcp://127.0.0.1:1", transport_address=b"x" * 64, layout=LLAMA3_8B,
                      num_tokens=2048, block_ids=list(range(128)), hidden=[])


def _one_life(d: KVDirectory, rid: str) -> bool:
    ok = d.publish_ready(_location(rid))
    entry = d.get(rid)
    ok &= entry is not None and entry.state == TransferState.READY and entry.location.request_id == rid
    consumed, _ = DirectoryBatch(d).transition(rid, {TransferState.READY}, TransferState.CONSUMED) \
        .delete(rid).execute()
    return bool(ok and consumed)


def _batch_life(d: KVDirectory, rids: list[str]) -> bool:
    b = DirectoryBatch(d)
    for rid in rids:
        b.publish_ready(_location(rid))
    for rid in rids:
        b.get(rid)
    for rid in rids:
        b.transition(rid, {TransferState.READY}, TransferState.CONSUMED).delete(rid)
    out = b.execute()
    n = len(rids)
    looked = out[n:2 * n]
    return all(out[:n]) and all(isinstance(e, DirectoryEntry) and e.state == TransferState.READY for e in looked) \
        and all(out[2 * n::2])


def _ping_latencies(d: KVDirectory, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        d._redis.ping()
        out.append(time.perf_counter() - start)
    return out


def _p99_ms(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 3)


def bench_directory(redis_url: str, requests: int, batch: int) -> DirectoryResult:
    d = KVDirectory(redis_url, entry_ttl_s=60.0)
    try:
        verified = all(_one_life(d, f"warm-{i}") for i in range(50))
        lat, floor, ping = [], [], []
        for i in range(min(requests, 5000)):
            ping.extend(_ping_latencies(d, 1))
            start = time.perf_counter()
            verified &= _one_life(d, f"lat-{i}")
            lat.append(time.perf_counter() - start)
            floor.append(sum(_ping_latencies(d, 3)))
        start = time.perf_counter()
        for first in range(0, requests, batch):
            verified &= _batch_life(d, [f"tp-{i}" for i in range(first, min(first + batch, requests))])
        elapsed = time.perf_counter() - start
        verified &= not d.request_ids()  # every entry deleted
        lat.sort()
        return DirectoryResult(requests=requests, batch=batch,
                               ops_per_s=round(requests * STEPS_PER_REQUEST / elapsed),
                               requests_per_s=round(requests / elapsed),
                               roundtrip_p50_ms=round(statistics.median(lat) * 1e3, 3),
                               roundtrip_p99_ms=_p99_ms(lat), ping_p50_ms=round(statistics.median(ping) * 1e3, 3),
                               ping_p99_ms=_p99_ms(ping),
                               three_pings_p50_ms=round(statistics.median(floor) * 1e3, 3),
                               three_pings_p99_ms=_p99_ms(floor), verified=verified)
    finally:
        d.close()
