"""ucxx's own tag send / receive of the benchmark's pieces, with nothing of kvwire's control path around it.

The floor under kvwire's UCX connector: the same transport settings (connectors/transports/ucx/worker.py),
one worker on each side, one tagged message per piece, no directory, no pull request, no lanes,
no packing. The consumer posts a receive per piece, tells the producer to go, and times until
every receive has completed; the producer posts a send per piece and polls until they complete.
Comparing `ucx` with `ucxx-raw` shows what kvwire adds to ucxx; comparing `ucxx-raw` with `nixl`
shows what ucxx's tag protocol costs against NIXL's one-sided operations.

Lifecycle of `run_ucxx_raw`:

1. Spawn the two sides (bench/sides.py).
2. Step them through the trials over pipes.
3. Join them.
"""

from __future__ import annotations

import time

from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.sides import TIMEOUT_S, Sides
from kvwire.bench.workload import Workload, allocate_pool, checksum, fill_random, zero_blocks
from kvwire.connectors.transports.kv_region import KVRegion


def _side(work: Workload, trials: int, warmup: int, side: int, pipe) -> None:
    """side 0 sends (producer), side 1 receives and times (consumer)."""
    import torch

    from kvwire.connectors.transports.ucx.worker import Array, Role, UCXWorker, tag_of, ucx

    torch.set_num_threads(1)
    region = KVRegion.from_kv_caches(allocate_pool(work))
    if side == 0:
        fill_random(region)
    transport = UCXWorker(Role.PRODUCER if side == 0 else Role.CONSUMER)
    pipe.send((transport.address, checksum(region, work.block_ids(0)) if side == 0 else 0))
    peer, want = pipe.recv()
    (ep,) = transport.link(peer).endpoints
    parts = region.parts(work.runs(side))
    times, cpu = [], CpuTally()
    for i in range(trials):
        tags = [ucx.UCXXTag(tag_of(i + 1, j, False)) for j in range(len(parts))]
        if side == 1:
            zero_blocks(region, work.block_ids(1))
            reqs = [(ep.tag_recv(buf, tag), buf) for buf, tag in zip((Array(p) for p in parts), tags)]
            pipe.send("posted")
            with cpu.counting(i >= warmup):
                start = time.perf_counter()
                pipe.send("go")
                _poll(transport, reqs)
                times.append(time.perf_counter() - start)
        else:
            pipe.recv()  # go
            _poll(transport, [(ep.tag_send(buf, tag), buf) for buf, tag in zip((Array(p) for p in parts), tags)])
        pipe.send("done")
        pipe.recv()  # next
    verified = side == 0 or checksum(region, work.block_ids(1)) == want
    pipe.send((times[warmup:], verified, tuple(cpu.ticks)))
    pipe.recv()  # hold the pool until the peer is finished too
    transport.close()


def _poll(transport, reqs) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not all(req.completed for req, _ in reversed(reqs)):
        transport.progress()
        if time.monotonic() > deadline:
            raise RuntimeError("ucxx transfer did not complete")
    for req, _ in reqs:
        req.check_error()


def run_ucxx_raw(work: Workload, runs: int, warmup: int, env: dict[str, str] | None = None
                 ) -> tuple[list[float], bool, CpuTicks]:
    """Seconds of each measured trial (the consumer's clock), whether the bytes matched after the last,
    and the host's CPU ticks inside the measured trials."""
    trials = warmup + runs
    sides = Sides(_side, (work, trials, warmup), env or {}, "ucxx")
    try:
        hello = [sides.recv(0), sides.recv(1)]
        sides.send(0, (hello[1][0], 0))
        sides.send(1, hello[0])
        for _ in range(trials):
            sides.recv(1)  # posted
            sides.recv(1)  # go: its clock runs
            sides.send(0, "go")
            sides.recv(0), sides.recv(1)  # both done
            for s in (0, 1):
                sides.send(s, "next")
        sides.recv(0)
        times, verified, ticks = sides.recv(1)
        for s in (0, 1):
            sides.send(s, "bye")
        return times, verified, CpuTicks(*ticks)
    finally:
        sides.close()
