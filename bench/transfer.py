"""`kvwire bench transfer`: every method on the same work, sizes × placements × pool layouts."""

from __future__ import annotations

from collections.abc import Callable

from kvwire.bench.choices import Device, Method, Placement
from kvwire.bench.connector_run import run_connector
from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.limits import limit_memcpy, limit_tcp
from kvwire.bench.nixl_run import NixlOp, run_nixl
from kvwire.bench.report import Row, make_row
from kvwire.bench.ucxx_run import run_ucxx_raw
from kvwire.bench.workload import Workload
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.wire import PoolLayout

# UCX over TCP only, and over the loopback device: on these machines traffic must stay on loopback
TCP_ONLY = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


# NIXL's faster operation on each transport here (measured both ways; see docs/BENCHMARKS.md)
NIXL_OPS = {Method.NIXL: NixlOp.READ, Method.NIXL_TCP: NixlOp.WRITE}

# kvwire connectors whose peers map the pool need it allocated by the connector: kvwire's layout only
KVWIRE_POOL_ONLY = {Method.SHM, Method.AUTO}
# what runs on GPU pools with one GPU: the device's own copy and the connectors that move device memory
# between two processes on it (NCCL needs two devices; the TCP limit and NIXL are host-memory baselines here)
ON_CUDA = {Method.LIMIT_MEMCPY, Method.UCX, Method.SHM, Method.TCP, Method.AUTO}


def supports(method: Method, pool: PoolLayout, device: Device = Device.CPU) -> bool:
    return (pool == PoolLayout.KVWIRE or method not in KVWIRE_POOL_ONLY) and \
        (device == Device.CPU or method in ON_CUDA)


def measure(method: Method, work: Workload, runs: int, warmup: int, redis_url: str
            ) -> tuple[list[float], bool, int | None, CpuTicks]:
    """Seconds per measured run of `method` on `work`, whether the bytes were verified, (connectors
    only) the peak extra memory of either process during the measured runs, and the host's CPU ticks
    inside them (bench/cpu.py)."""
    if method == Method.LIMIT_MEMCPY:
        times, ok, cpu = limit_memcpy(work, runs, warmup)
        return times, ok, None, cpu
    if method == Method.LIMIT_TCP:
        times, ok, cpu = limit_tcp(work, runs, warmup)
        return times, ok, None, cpu
    if method in NIXL_OPS:
        env = TCP_ONLY if method == Method.NIXL_TCP else None
        times, ok, cpu = run_nixl(work, runs, warmup, NIXL_OPS[method], env)
        return times, ok, None, cpu
    if method in (Method.UCXX_RAW, Method.UCXX_RAW_TCP):
        times, ok, cpu = run_ucxx_raw(work, runs, warmup, TCP_ONLY if method == Method.UCXX_RAW_TCP else None)
        return times, ok, None, cpu
    if method == Method.UCX_TCP:
        return run_connector(ConnectorKind.UCX, work, runs, warmup, redis_url, env=TCP_ONLY)
    return run_connector(ConnectorKind(method.value), work, runs, warmup, redis_url)


def bench_transfer(methods: list[Method], tokens: list[int], placements: list[Placement], pools: list[PoolLayout],
                   runs: int, warmup: int, redis_url: str, on_row: Callable[[Row], None] = lambda r: None,
                   rounds: int = 1, device: Device = Device.CPU, hidden_width: int = 1) -> list[Row]:
    """Run every supported (tokens, placement, pool, method) combination, `rounds` times over.

    Rounds interleave the methods: each round runs every combination for `runs` runs, and a
    row's figures pool the runs of all rounds, so a slow spell of the machine (a shared VM's
    neighbours) lands on every method instead of on whichever ran during it. `on_row` sees
    each combination's row for the round just run (progress); the returned rows pool them all.
    """
    import torch

    torch.set_num_threads(1)  # this process is the consumer; idle OpenMP workers spinning would steal a core
    combos = [(Workload(n, placement, pool, device=device, hidden_width=hidden_width), method)
              for n in tokens for placement in placements for pool in pools for method in methods
              if supports(method, pool, device)]
    seconds: list[list[float]] = [[] for _ in combos]
    verified = [True] * len(combos)
    extra: list[int | None] = [None] * len(combos)
    cpu = [CpuTally() for _ in combos]
    for _ in range(rounds):
        for i, (work, method) in enumerate(combos):
            got, ok, peak, ticks = measure(method, work, runs, warmup, redis_url)
            seconds[i] += got
            verified[i] &= ok
            prev = extra[i]
            extra[i] = peak if prev is None else max(prev, peak or 0)
            cpu[i].add(ticks)
            on_row(make_row(method.value, work, got, ok, peak, CpuTally.of(ticks).shares()))
    return [make_row(method.value, work, seconds[i], verified[i], extra[i], cpu[i].shares())
            for i, (work, method) in enumerate(combos)]


def combinations(methods: list[Method], tokens: list[int], placements: list[Placement],
                 pools: list[PoolLayout], device: Device = Device.CPU) -> int:
    return len(tokens) * len(placements) * sum(supports(m, p, device) for m in methods for p in pools)


# The issues' targets: (method, compared with, at least this ratio of their medians)
TARGETS = [(Method.SHM, Method.LIMIT_MEMCPY, 0.8), (Method.UCX, Method.NIXL, 1.0),
           (Method.UCX_TCP, Method.NIXL_TCP, 1.0), (Method.TCP, Method.LIMIT_TCP, 0.8)]
# A request of one block is mostly control path: lower bars up to this many tokens
SMALL_REQUEST_TOKENS = 16
SMALL_REQUEST_TARGETS = {Method.SHM: 0.5, Method.TCP: 0.6}


def target_lines(rows: list[Row]) -> list[str]:
    """One line per target whose two methods ran on the same work: the ratio of medians, met or missed."""
    by_key = {(r.method, r.tokens, r.layout, r.pool): r for r in rows}
    lines = []
    for (tokens, layout, pool) in dict.fromkeys((r.tokens, r.layout, r.pool) for r in rows):
        for method, versus, least in TARGETS:
            if tokens <= SMALL_REQUEST_TOKENS:
                least = SMALL_REQUEST_TARGETS.get(method, least)
            a, b = by_key.get((method, tokens, layout, pool)), by_key.get((versus, tokens, layout, pool))
            if a and b:
                ratio = a.gbps_median / b.gbps_median
                lines.append(f"{tokens:>6} {layout:<10} {pool:<6} {method:>8} / {versus:<12} {ratio:5.2f}  "
                             f"(target >= {least}: {'met' if ratio >= least else 'missed'})")
    return lines
