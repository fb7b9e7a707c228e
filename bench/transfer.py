"""`kvwire bench transfer`: every method on the same work, sizes × placements × pool layouts.

A method that raises on a piece of work (a transport that refuses a pool, a peer that fails) gets a row that
says why instead of figures; the others run on. Peers that are not installed (NIXL) are left out, and
`unavailable` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvwire.bench.choices import Device, Method, Placement
from kvwire.bench.connector_run import run_connector
from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.limits import limit_gather, limit_memcpy, limit_tcp
from kvwire.bench.nixl_run import NIXL_MODULES, NixlOp, nixl_module, run_nixl
from kvwire.bench.report import Row, error_row, make_row
from kvwire.bench.ucxx_run import run_ucxx_raw
from kvwire.bench.workload import Workload
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.wire import PoolLayout

# UCX over TCP only, and over the loopback device: on these machines traffic must stay on loopback
TCP_ONLY = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
# UCX turns cuda_ipc's get (NIXL's READ) off where it finds no active NVLink (one GPU, or GPUs on PCIe) and
# READ then takes a TCP emulation through host memory; `on` keeps it (UCX's default is `auto`)
CUDA_IPC_GET = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}

# NIXL's faster operation on each transport here (measured both ways; see docs/BENCHMARKS.md)
NIXL_OPS = {Method.NIXL: NixlOp.READ, Method.NIXL_TCP: NixlOp.WRITE, Method.NIXL_DEFAULTS: NixlOp.READ}

# what runs on GPU pools with one GPU: the device's own copy, the connectors that move device memory between
# two processes on it, and NIXL on VRAM (NCCL needs two devices; the TCP limit and UCX_TLS=tcp variants are
# host-memory baselines)
ON_CUDA = {Method.LIMIT_MEMCPY, Method.LIMIT_GATHER, Method.UCX, Method.SHM, Method.TCP, Method.AUTO, Method.NIXL,
           Method.NIXL_DEFAULTS}
GPU_ONLY = {Method.NIXL_DEFAULTS}  # on the host it would be `nixl` again


def supports(method: Method, device: Device = Device.CPU) -> bool:
    """Whether `method` runs on pools on `device`. Every pool layout is tried: a transport that refuses one
    says so in its row."""
    return method in ON_CUDA if device == Device.CUDA else method not in GPU_ONLY


def unavailable(methods: list[Method]) -> dict[Method, str]:
    """The methods among `methods` whose peer library is not installed here, each with why: no rows."""
    if nixl_module() is not None:
        return {}
    return {m: f"NIXL is not installed here (none of {', '.join(NIXL_MODULES)})" for m in methods if m in NIXL_OPS}


def nixl_settings(method: Method, device: Device) -> dict[str, str]:
    """The UCX settings a NIXL method runs with, beyond UCX's defaults."""
    if method == Method.NIXL_TCP:
        return TCP_ONLY
    if method == Method.NIXL and device == Device.CUDA:
        return CUDA_IPC_GET
    return {}


class Measured(NamedTuple):
    seconds: list[float]  # each measured run
    verified: bool
    extra: int | None  # connectors: the peak extra memory of either process during the measured runs
    cpu: CpuTicks  # the host's CPU ticks inside the measured runs (bench/cpu.py)
    protocol: str | None = None  # NIXL: the UCX protocol its initiator selected


def measure(method: Method, work: Workload, runs: int, warmup: int, redis_url: str) -> Measured:
    """`method` moving `work`: `warmup` unmeasured runs, then `runs` measured ones.

    Raises:
        Exception: whatever the method raised (a transport refusing the pool, a peer failing).
    """
    if method == Method.LIMIT_MEMCPY:
        return _limit(limit_memcpy(work, runs, warmup))
    if method == Method.LIMIT_TCP:
        return _limit(limit_tcp(work, runs, warmup))
    if method == Method.LIMIT_GATHER:
        return _limit(limit_gather(work, runs, warmup))
    if method in NIXL_OPS:
        got = run_nixl(work, runs, warmup, NIXL_OPS[method], nixl_settings(method, work.device))
        return Measured(got.seconds, got.verified, None, got.cpu, got.protocol)
    if method in (Method.UCXX_RAW, Method.UCXX_RAW_TCP):
        return _limit(run_ucxx_raw(work, runs, warmup, TCP_ONLY if method == Method.UCXX_RAW_TCP else None))
    if method == Method.UCX_TCP:
        return Measured(*run_connector(ConnectorKind.UCX, work, runs, warmup, redis_url, env=TCP_ONLY))
    return Measured(*run_connector(ConnectorKind(method.value), work, runs, warmup, redis_url))


def _limit(got: tuple[list[float], bool, CpuTicks]) -> Measured:
    seconds, verified, cpu = got
    return Measured(seconds, verified, None, cpu)


def bench_transfer(methods: list[Method], tokens: list[int], placements: list[Placement], pools: list[PoolLayout],
                   runs: int, warmup: int, redis_url: str, on_row: Callable[[Row], None] = lambda r: None,
                   rounds: int = 1, device: Device = Device.CPU, hidden_width: int = 1) -> list[Row]:
    """Run every supported (tokens, placement, pool, method) combination, `rounds` times over.

    Rounds interleave the methods: each round runs every combination for `runs` runs, and a
    row's figures pool the runs of all rounds, so a slow spell of the machine (a shared VM's
    neighbours) lands on every method instead of on whichever ran during it. `on_row` sees
    each combination's row for the round just run (progress); the returned rows pool them all.
    A combination that raised has a row with its error (`Row.error`) and is not run again;
    methods in `unavailable(methods)` have no rows.
    """
    import torch

    torch.set_num_threads(1)  # this process is the consumer; idle OpenMP workers spinning would steal a core
    combos = _combos(methods, tokens, placements, pools, device, hidden_width)
    seconds: list[list[float]] = [[] for _ in combos]
    verified = [True] * len(combos)
    extra: list[int | None] = [None] * len(combos)
    cpu = [CpuTally() for _ in combos]
    protocol: list[str | None] = [None] * len(combos)
    errors: list[str | None] = [None] * len(combos)
    for _ in range(rounds):
        for i, (work, method) in enumerate(combos):
            if errors[i] is not None:
                continue
            try:
                got = measure(method, work, runs, warmup, redis_url)
            except Exception as exc:  # any failure is the row's to report; the other combinations run on
                reason = errors[i] = _reason(exc)
                on_row(error_row(method.value, work, reason))
                continue
            seconds[i] += got.seconds
            verified[i] &= got.verified
            prev = extra[i]
            extra[i] = got.extra if prev is None else max(prev, got.extra or 0)
            cpu[i].add(got.cpu)
            protocol[i] = protocol[i] or got.protocol
            on_row(make_row(method.value, work, got.seconds, got.verified, got.extra, CpuTally.of(got.cpu).shares(),
                            got.protocol))
    return [error_row(method.value, work, err) if (err := errors[i]) is not None else
            make_row(method.value, work, seconds[i], verified[i], extra[i], cpu[i].shares(), protocol[i])
            for i, (work, method) in enumerate(combos)]


def _combos(methods: list[Method], tokens: list[int], placements: list[Placement], pools: list[PoolLayout],
            device: Device, hidden_width: int = 1) -> list[tuple[Workload, Method]]:
    missing = unavailable(methods)
    return [(Workload(n, placement, pool, device=device, hidden_width=hidden_width), method)
            for n in tokens for placement in placements for pool in pools for method in methods
            if supports(method, device) and method not in missing]


def _reason(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."


def combinations(methods: list[Method], tokens: list[int], placements: list[Placement],
                 pools: list[PoolLayout], device: Device = Device.CPU) -> int:
    return len(_combos(methods, tokens, placements, pools, device))


# The issues' targets: (method, compared with, at least this ratio of their medians)
TARGETS = [(Method.SHM, Method.LIMIT_MEMCPY, 0.8), (Method.SHM, Method.LIMIT_GATHER, 0.5),
           (Method.AUTO, Method.LIMIT_GATHER, 0.5), (Method.UCX, Method.NIXL, 1.0),
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
            if a and b and a.error is None and b.error is None:
                ratio = a.gbps_median / b.gbps_median
                lines.append(f"{tokens:>6} {layout:<10} {pool:<6} {method:>8} / {versus:<12} {ratio:5.2f}  "
                             f"(target >= {least}: {'met' if ratio >= least else 'missed'})")
    return lines
