"""Rows of a transfer benchmark, printed as a table or as JSON."""

from __future__ import annotations

import statistics

import msgspec

from kvwire.bench.cpu import CpuShares
from kvwire.bench.workload import Workload


class Row(msgspec.Struct, frozen=True):
    method: str  # a connector's name, limit-memcpy, limit-tcp, or a NIXL variant (bench/choices.py)
    tokens: int
    layout: str  # scattered or contiguous
    pool: str  # whose pool layout: kvwire (block-major) or vllm (per-layer K and V)
    bytes: int
    runs: int
    gbps_median: float
    gbps_min: float
    gbps_max: float
    ms_median: float
    verified: bool
    extra_mib: float | None = None  # connectors: peak memory either process added during the runs
    device: str = "cpu"  # where both pools lived: cpu or cuda
    cpu: CpuShares | None = None  # the host's cores inside the measured runs: busy, in the kernel, stolen
    protocol: str | None = None  # NIXL: the UCX protocol its initiator selected (UCX_PROTO_INFO)
    error: str | None = None  # why the method did not run on this work (then no runs and no figures)


def make_row(method: str, work: Workload, seconds: list[float], verified: bool, extra: int | None = None,
             cpu: CpuShares | None = None, protocol: str | None = None) -> Row:
    nbytes = work.nbytes
    gbps = [nbytes / s / 1e9 for s in seconds]
    return Row(method=method, tokens=work.tokens, layout=str(work.placement), pool=str(work.pool), bytes=nbytes,
               runs=len(seconds),
               gbps_median=round(statistics.median(gbps), 3), gbps_min=round(min(gbps), 3),
               gbps_max=round(max(gbps), 3), ms_median=round(statistics.median(seconds) * 1e3, 2),
               verified=verified, extra_mib=None if extra is None else round(extra / 2**20, 1),
               device=str(work.device), cpu=cpu, protocol=protocol)


def error_row(method: str, work: Workload, error: str) -> Row:
    """The row of a method that did not run on `work`: the transport refused it, or it failed."""
    return Row(method=method, tokens=work.tokens, layout=str(work.placement), pool=str(work.pool), bytes=work.nbytes,
               runs=0, gbps_median=0.0, gbps_min=0.0, gbps_max=0.0, ms_median=0.0, verified=False,
               device=str(work.device), error=error)


PROTOCOL_HEADING = "NIXL's UCX protocol (UCX_PROTO_INFO=y: what the initiator's UCX selected for the pieces):"


def protocol_lines(rows: list[Row]) -> list[str]:
    """One line per row that names its UCX protocol (NIXL's)."""
    return [f"  {r.method:<13} {r.tokens:>6} {r.layout:<10} {r.pool:<6} {r.device:<4}  {r.protocol}"
            for r in rows if r.protocol is not None]


def table(rows: list[Row]) -> str:
    head = (f"{'method':<13} {'tokens':>6} {'layout':<10} {'pool':<6}{' dev ' if _any_gpu(rows) else ''} "
            f"{'MiB':>7} {'GB/s med':>8} "
            f"{'min':>6} {'max':>6} {'ms med':>8} {'+MiB':>6} {'cpu%':>5} {'sys%':>5}  verified")
    lines = [head, "-" * len(head)]
    for r in rows:
        work = (f"{r.method:<13} {r.tokens:>6} {r.layout:<10} {r.pool:<6}"
                f"{f' {r.device:<4}' if _any_gpu(rows) else ''} {r.bytes / 2**20:>7.1f} ")
        if r.error is not None:
            lines.append(f"{work}did not run: {r.error}")
            continue
        lines.append(f"{work}{r.gbps_median:>8.2f} {r.gbps_min:>6.2f} {r.gbps_max:>6.2f} {r.ms_median:>8.2f} "
                     f"{'-' if r.extra_mib is None else f'{r.extra_mib:.1f}':>6} {_pct(r.cpu, 'busy'):>5} "
                     f"{_pct(r.cpu, 'kernel'):>5}  "
                     f"{'yes' if r.verified else 'NO'}")
    return "\n".join(lines)


def _pct(cpu: CpuShares | None, share: str) -> str:
    return "-" if cpu is None else f"{100 * getattr(cpu, share):.0f}"


def _any_gpu(rows: list[Row]) -> bool:
    return any(r.device != "cpu" for r in rows)


def to_json(rows: list[Row]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(rows), indent=2)
