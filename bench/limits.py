"""The machine's limits on the same work: one process copying, and raw TCP with iovecs.

Both move exactly the pieces a connector moves between kvwire's block-major pools: one
piece per run of blocks consecutive on both sides.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import torch

from bench.workload import Workload, checksum, fill_random
from connectors.kv_region import plan_runs
from connectors.tcp.stream import ByteStream, Staging, byte_parts


def _planes(work: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.kv_cache import KVPool

    src = KVPool.allocate(work.layout, work.pool_blocks)
    fill_random(src.data)
    dst = KVPool.allocate(work.layout, work.pool_blocks)
    return src.blocks_as_bytes(), dst.blocks_as_bytes()


def limit_memcpy(work: Workload, runs: int, warmup: int) -> tuple[list[float], bool]:
    """Single-process gather → scatter of the request's blocks, one copy per byte."""
    src, dst = _planes(work)
    s_ids, d_ids = work.block_ids(0), work.block_ids(1)
    runs_ = plan_runs(s_ids, d_ids)
    times = []
    for i in range(warmup + runs):
        dst.zero_()
        start = time.perf_counter()
        for s, d, n in runs_:
            dst[d:d + n].copy_(src[s:s + n])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, checksum(src, s_ids) == checksum(dst, d_ids)


def _stream(plane: torch.Tensor, runs: list[tuple[int, int]], outbound: bool) -> ByteStream:
    """The runs' bytes as the TCP connector's own scatter/gather cursor (host memory: no staging)."""
    return ByteStream(byte_parts([plane[s:s + n].view(-1) for s, n in runs]), outbound, Staging())


def _tcp_sender(work: Workload, port_q, trials: int) -> None:
    torch.set_num_threads(1)
    src, _ = _planes(work)
    runs_ = [(s, n) for s, _, n in plan_runs(work.block_ids(0), work.block_ids(1))]
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_q.put((srv.getsockname()[1], checksum(src, work.block_ids(0))))
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(trials):
                conn.recv(1)  # "go"
                stream = _stream(src, runs_, outbound=True)
                while not stream.done:
                    stream.advance(conn.sendmsg(stream.batch()))


def _recv_all(sock: socket.socket, stream: ByteStream) -> None:
    while not stream.done:
        got = sock.recvmsg_into(stream.batch())[0]
        if got == 0:
            raise ConnectionError("sender closed early")
        stream.advance(got)


def limit_tcp(work: Workload, runs: int, warmup: int) -> tuple[list[float], bool]:
    """A raw TCP loopback stream between two processes, scatter/gather on both ends."""
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_tcp_sender, args=(work, port_q, warmup + runs))
    proc.start()
    try:
        port, want = port_q.get(timeout=120)
        _, dst = _planes(work)
        runs_ = [(d, n) for _, d, n in plan_runs(work.block_ids(0), work.block_ids(1))]
        times = []
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for i in range(warmup + runs):
                start = time.perf_counter()
                sock.send(b"g")
                _recv_all(sock, _stream(dst, runs_, outbound=False))
                if i >= warmup:
                    times.append(time.perf_counter() - start)
        return times, checksum(dst, work.block_ids(1)) == want
    finally:
        proc.join(30)
        proc.kill()
