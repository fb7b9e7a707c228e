"""The machine's limits on the same work: one process copying, and raw TCP with iovecs.

Both move exactly the pieces a connector moves between the same pools: one piece per
run of blocks consecutive on both sides, per plane (one plane in kvwire's pool, a K
and a V plane per layer in vLLM's).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch

from kvwire.bench.choices import Device
from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.procs import helper_context
from kvwire.bench.workload import Workload, allocate_pool, checksum, fill_random, zero_blocks
from kvwire.connectors.transports.block_copy import copy_blocks
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.transports.tcp.stream import pump


def _region(work: Workload, filled: bool) -> KVRegion:
    region = KVRegion.from_kv_caches(allocate_pool(work))
    if filled:
        fill_random(region)
    return region


def limit_memcpy(work: Workload, runs: int, warmup: int) -> tuple[list[float], bool, CpuTicks]:
    """Single-process gather → scatter of the request's pieces as the connectors copy them (block_copy.py):
    a `copy_` per piece on the host unless the pieces are small, a gather/scatter per plane on a GPU."""
    block_runs = plan_runs(work.block_ids(0), work.block_ids(1))
    return _timed_copies(work, runs, warmup, lambda dst, src: copy_blocks(dst.planes, src.planes, block_runs))


def limit_gather(work: Workload, runs: int, warmup: int) -> tuple[list[float], bool, CpuTicks]:
    """Single-process gather → scatter plane by plane with index_select / index_copy_ (no stacking, no rounds)."""
    device = torch.device("cuda" if work.device == Device.CUDA else "cpu")
    src_idx = torch.tensor(work.block_ids(0), dtype=torch.int64, device=device)  # [blocks]
    dst_idx = torch.tensor(work.block_ids(1), dtype=torch.int64, device=device)  # [blocks]

    def gather(dst: KVRegion, src: KVRegion) -> None:
        for d, s in zip(dst.planes, src.planes):
            d.index_copy_(0, dst_idx, s.index_select(0, src_idx))  # [blocks, row] scratch a plane

    return _timed_copies(work, runs, warmup, gather)


def _timed_copies(work: Workload, runs: int, warmup: int,
                  copy: Callable[[KVRegion, KVRegion], None]) -> tuple[list[float], bool, CpuTicks]:
    """`copy(dst, src)` of the request's blocks between two pools of one process, timed to the device's end."""
    src, dst = _region(work, True), _region(work, False)
    sync = torch.cuda.synchronize if work.device == Device.CUDA else (lambda: None)
    times, cpu = [], CpuTally()
    for i in range(warmup + runs):
        zero_blocks(dst, work.block_ids(1))
        sync()
        with cpu.counting(i >= warmup):
            start = time.perf_counter()
            copy(dst, src)
            sync()  # a device copy is done when the device says so
            elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return times, checksum(src, work.block_ids(0)) == checksum(dst, work.block_ids(1)), cpu.ticks


def _tcp_sender(work: Workload, port_q, trials: int) -> None:
    torch.set_num_threads(1)
    src = _region(work, True)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_q.put((srv.getsockname()[1], checksum(src, work.block_ids(0))))
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(trials):
                conn.recv(1)  # "go"
                pump(conn, src.pieces(work.runs(0)), outbound=True)


def limit_tcp(work: Workload, runs: int, warmup: int) -> tuple[list[float], bool, CpuTicks]:
    """A raw TCP loopback stream between two processes, scatter/gather on both ends."""
    ctx = helper_context()
    port_q = ctx.Queue()
    proc = ctx.Process(target=_tcp_sender, args=(work, port_q, warmup + runs))
    proc.start()
    try:
        port, want = port_q.get(timeout=120)
        dst = _region(work, False)
        times, cpu = [], CpuTally()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for i in range(warmup + runs):
                zero_blocks(dst, work.block_ids(1))
                with cpu.counting(i >= warmup):
                    start = time.perf_counter()
                    sock.send(b"g")
                    pump(sock, dst.pieces(work.runs(1)), outbound=False)
                    elapsed = time.perf_counter() - start
                if i >= warmup:
                    times.append(elapsed)
        return times, checksum(dst, work.block_ids(1)) == want, cpu.ticks
    finally:
        proc.join(30)
        proc.kill()
