"""`kvwire bench transfer`: every method on the same work, sizes × placements."""

from __future__ import annotations

import enum
from typing import Callable

from bench.connector_run import run_connector
from bench.limits import limit_memcpy, limit_tcp
from bench.report import Row, make_row
from bench.workload import Placement, Workload
from connectors.config import ConnectorKind


class Method(enum.StrEnum):
    LIMIT_MEMCPY = "limit-memcpy"
    LIMIT_TCP = "limit-tcp"
    UCX = "ucx"
    UCX_TCP = "ucx-tcp"  # UCX restricted to TCP (UCX_TLS=tcp)
    SHM = "shm"
    TCP = "tcp"
    NCCL = "nccl"
    AUTO = "auto"


def measure(method: Method, work: Workload, runs: int, warmup: int, redis_url: str) -> tuple[list[float], bool]:
    """Seconds per measured run of `method` on `work`, and whether the bytes were verified."""
    if method == Method.LIMIT_MEMCPY:
        return limit_memcpy(work, runs, warmup)
    if method == Method.LIMIT_TCP:
        return limit_tcp(work, runs, warmup)
    if method == Method.UCX_TCP:
        return run_connector(ConnectorKind.UCX, work, runs, warmup, redis_url, env={"UCX_TLS": "tcp"})
    return run_connector(ConnectorKind(method.value), work, runs, warmup, redis_url)


def bench_transfer(methods: list[Method], tokens: list[int], placements: list[Placement], runs: int, warmup: int,
                   redis_url: str, on_row: Callable[[Row], None] = lambda r: None) -> list[Row]:
    """Run every (tokens, placement, method) combination; `on_row` sees each row as it is made."""
    rows = []
    for n in tokens:
        for placement in placements:
            work = Workload(n, placement)
            nbytes = work.num_blocks * work.layout.num_layers * 2 * work.layout.block_size \
                * work.layout.num_kv_heads * work.layout.head_dim * 2  # bfloat16
            for method in methods:
                seconds, verified = measure(method, work, runs, warmup, redis_url)
                row = make_row(method.value, n, placement.value, nbytes, seconds, verified)
                rows.append(row)
                on_row(row)
    return rows
