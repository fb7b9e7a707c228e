"""NIXL (UCX backend) moving the benchmark's work between two processes: the peer kvwire is measured against.

Driven the way vLLM's NixlConnector drives it, tuned for this machine: progress thread
off (on a small host it competes for the cores: docs/BENCHMARKS.md), each side's pool
registered once, both descriptor lists prepared once, and per request one
`make_prepped_xfer` over exactly the pieces kvwire's connectors move, then `transfer`
and polling until done.

READ (the consumer pulls, as kvwire does): the consumer process times from
`make_prepped_xfer` to DONE. WRITE (the producer pushes): the consumer process times
from telling the producer "go" to the notification that the write finished. The
target polls for the initiator's notification meanwhile (UCX needs the target's
worker progressed).
Both sides run in child processes (a UCX process may crash at exit on hosts with
libibverbs; the bench survives it).
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time

import numpy as np
import torch

from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.sides import TIMEOUT_S, Sides
from kvwire.bench.workload import Workload, allocate_pool, checksum, fill_random, piece_table, zero_blocks
from kvwire.connectors.transports.kv_region import KVRegion


class NixlOp(enum.StrEnum):
    READ = "READ"
    WRITE = "WRITE"


def _agent(name: str, region: KVRegion):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    agent.register_memory(piece_table(region, [(0, region.num_blocks)]), "DRAM")  # every plane, whole
    return agent


def _wait(agent, handle) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (state := agent.check_xfer_state(handle)) != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"NIXL transfer ended in state {state} "
                               f"after {time.monotonic() - deadline + TIMEOUT_S:.1f} s")
    agent.release_xfer_handle(handle)


def _side(work: Workload, op: NixlOp, trials: int, warmup: int, side: int, pipe) -> None:
    """side 0 holds the source pool (producer), side 1 the destination (consumer, which times); the first
    `warmup` of the `trials` are not counted."""
    sys.stdout = sys.stderr  # NIXL logs to stdout; the bench's stdout is its table or JSON
    logging.getLogger("nixl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    region = KVRegion.from_kv_caches(allocate_pool(work))
    if side == 0:
        fill_random(region)
    agent = _agent(f"bench-{side}", region)
    mine = piece_table(region, work.runs(side))
    pipe.send((agent.get_agent_metadata(), mine, checksum(region, work.block_ids(0)) if side == 0 else 0))
    peer_meta, theirs, want = pipe.recv()
    peer = agent.add_remote_agent(peer_meta)  # the peer's name, as bytes
    initiator = (side == 1) == (op == NixlOp.READ)
    if initiator:
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mine, "DRAM")
        remote = agent.prep_xfer_dlist(peer, theirs, "DRAM")
        idx = np.arange(len(mine), dtype=np.int32)
    times, cpu = [], CpuTally()
    for i in range(trials):
        if side == 1:
            zero_blocks(region, work.block_ids(1))
        pipe.send("ready")
        pipe.recv()
        with cpu.counting(i >= warmup):
            start = time.perf_counter()
            if initiator:
                handle = agent.make_prepped_xfer(op.value, local, idx, remote, idx, b"done")
                agent.transfer(handle)
                _wait(agent, handle)
            else:  # the target progresses its worker (the protocol needs it) until the initiator's notification
                _wait_notif(agent, peer)
            times.append(time.perf_counter() - start)
    verified = side == 0 or checksum(region, work.block_ids(1)) == want
    pipe.send((times, verified, tuple(cpu.ticks)))
    pipe.recv()  # hold the registered pool until the peer is finished too


def _wait_notif(agent, peer: bytes) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not agent.get_new_notifs().get(peer.decode()):
        if time.monotonic() > deadline:
            raise RuntimeError("no NIXL notification from the producer")


def run_nixl(work: Workload, runs: int, warmup: int, op: NixlOp, env: dict[str, str] | None = None
             ) -> tuple[list[float], bool, CpuTicks]:
    """Seconds of each measured trial (the consumer's clock), whether the last trial's bytes matched, and
    the host's CPU ticks inside the consumer's measured trials."""
    trials = warmup + runs
    # NIXL starts from UCX's defaults plus `env`: importing ucxx (this process's UCX connector runs) sets
    # UCX_* variables of its own (RNDV_THRESH, MEMTYPE_CACHE, ...), and inherited they cut NIXL to a quarter.
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("UCX_")}
    sides = Sides(_side, (work, op, trials, warmup), {**clean, **(env or {})}, "NIXL")
    try:
        hello = [sides.recv(0), sides.recv(1)]
        sides.send(0, (hello[1][0], hello[1][1], 0))
        sides.send(1, (hello[0][0], hello[0][1], hello[0][2]))
        for _ in range(trials):
            for s in (0, 1):
                sides.recv(s)  # both ready
            for s in (1, 0):  # consumer starts its clock first
                sides.send(s, "go")
        results = [sides.recv(0), sides.recv(1)]
        for s in (0, 1):
            sides.send(s, "bye")
        times, verified, ticks = results[1]
        return times[warmup:], verified, CpuTicks(*ticks)
    finally:
        sides.close()
