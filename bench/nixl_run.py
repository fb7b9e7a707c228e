"""NIXL (UCX backend) moving the benchmark's work between two processes: the peer kvwire is measured against.

Driven the way vLLM's NixlConnector drives it, tuned for this machine: progress thread
off (on a small host it competes for the cores: docs/BENCHMARKS.md), each side's pool
registered once, both descriptor lists prepared once, and per request one
`make_prepped_xfer` over exactly the pieces kvwire's connectors move, then `transfer`
and polling until done. A host pool is registered as DRAM; a GPU pool as VRAM on the device
that holds it (both sides of a one-GPU run register that device's index).

READ (the consumer pulls, as kvwire does): the consumer process times from
`make_prepped_xfer` to DONE. WRITE (the producer pushes): the consumer process times
from telling the producer "go" to the notification that the write finished. The
target polls for the initiator's notification meanwhile (UCX needs the target's
worker progressed).

NIXL's API names the backend a transfer took (UCX), not UCX's protocol, so each side runs with
`UCX_PROTO_INFO=y` and its own UCX log: the initiator's protocol tables say what carried the
pieces (bench/ucx_proto.py), e.g. "zero-copy cuda_ipc/cuda" or "software emulation tcp/lo".

Lifecycle of `run_nixl`:

1. Spawn the two sides (bench/sides.py). Each starts from UCX's defaults (every inherited UCX_*
   variable dropped) plus the settings asked for, before it loads NIXL. Both sides run in child
   processes (a UCX process may crash at exit on hosts with libibverbs; the bench survives it).
2. Step them through the trials over pipes.
3. Join them; read the initiator's UCX log for its protocol, and pass its warnings on.
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvwire.bench.choices import Device
from kvwire.bench.cpu import CpuTally, CpuTicks
from kvwire.bench.sides import TIMEOUT_S, Sides
from kvwire.bench.ucx_proto import chosen, notices
from kvwire.bench.workload import Workload, allocate_pool, checksum, fill_random, piece_table, zero_blocks
from kvwire.connectors.transports.kv_region import KVRegion

log = logging.getLogger(__name__)

# NIXL's Python packages, the first installed one used: the CUDA 13 build (the GPU image's CUDA; `.ci/gpu pack`
# carries it) before the CUDA 12 one (the CPU install's bench extra)
NIXL_MODULES = ("nixl_cu13", "nixl_cu12")


class NixlOp(enum.StrEnum):
    READ = "READ"
    WRITE = "WRITE"


# how UCX_PROTO_INFO names the UCX operation behind each NIXL operation (ucp_get, ucp_put)
UCX_OPERATION = {NixlOp.READ: "remote memory read", NixlOp.WRITE: "remote memory write"}


class NixlResult(NamedTuple):
    seconds: list[float]  # each measured trial, the consumer's clock
    verified: bool  # the last trial's bytes matched
    cpu: CpuTicks  # the host's CPU ticks inside the consumer's measured trials
    protocol: str  # what the initiator's UCX selected for the operation, or why that is not known


def nixl_module() -> str | None:
    """The NIXL package installed here, found without importing it (its UCX stays out of this process)."""
    return next((name for name in NIXL_MODULES if importlib.util.find_spec(name) is not None), None)


def memory_type(device: Device) -> str:
    """NIXL's name for the memory a pool on `device` lives in."""
    return "VRAM" if device == Device.CUDA else "DRAM"


def _agent(module: str, name: str, region: KVRegion, mem: str):
    api = importlib.import_module(f"{module}._api")
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    agent.register_memory(piece_table(region, [(0, region.num_blocks)]), mem)  # every plane, whole
    return agent


def _wait(agent, handle) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (state := agent.check_xfer_state(handle)) != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"NIXL transfer ended in state {state} "
                               f"after {time.monotonic() - deadline + TIMEOUT_S:.1f} s")
    agent.release_xfer_handle(handle)


def _side(work: Workload, op: NixlOp, trials: int, warmup: int, module: str, ucx_env: dict[str, str],
          logs: str, side: int, pipe) -> None:
    """side 0 holds the source pool (producer), side 1 the destination (consumer, which times); the first
    `warmup` of the `trials` are not counted. UCX's settings are set here, before NIXL loads UCX."""
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        del os.environ[key]
    os.environ.update({**ucx_env, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": _log_path(logs, side)})
    sys.stdout = sys.stderr  # NIXL logs to stdout; the bench's stdout is its table or JSON
    logging.getLogger("nixl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if work.device == Device.CUDA else (lambda: None)
    region = KVRegion.from_kv_caches(allocate_pool(work))
    if side == 0:
        fill_random(region)
    mem = memory_type(work.device)
    agent = _agent(module, f"bench-{side}", region, mem)
    mine = piece_table(region, work.runs(side))
    pipe.send((agent.get_agent_metadata(), mine, checksum(region, work.block_ids(0)) if side == 0 else 0))
    peer_meta, theirs, want = pipe.recv()
    peer = agent.add_remote_agent(peer_meta)  # the peer's name, as bytes
    initiator = (side == 1) == (op == NixlOp.READ)
    if initiator:
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mine, mem)
        remote = agent.prep_xfer_dlist(peer, theirs, mem)
        idx = np.arange(len(mine), dtype=np.int32)
    times, cpu = [], CpuTally()
    for i in range(trials):
        if side == 1:
            zero_blocks(region, work.block_ids(1))
            sync()  # zeroed before UCX copies on its own streams
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
    ctypes.CDLL(None).fflush(None)  # UCX's log is a buffered C stream: written out before the parent reads it
    sizes = (int(mine[:, 1].min()), int(mine[:, 1].max()))
    pipe.send((times, verified, tuple(cpu.ticks), sizes))
    pipe.recv()  # hold the registered pool until the peer is finished too


def _wait_notif(agent, peer: bytes) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not agent.get_new_notifs().get(peer.decode()):
        if time.monotonic() > deadline:
            raise RuntimeError("no NIXL notification from the producer")


def _log_path(logs: str, side: int) -> str:
    return str(Path(logs) / f"ucx-side{side}.log")


def run_nixl(work: Workload, runs: int, warmup: int, op: NixlOp, ucx_env: Mapping[str, str] | None = None
             ) -> NixlResult:
    """NIXL moving `work`, `warmup` unmeasured trials then `runs` measured ones.

    Args:
        ucx_env: UCX settings (UCX_* variables) on top of UCX's defaults, for both sides.
    Raises:
        RuntimeError: NIXL is not installed, or a side failed or stopped answering.
    """
    module = nixl_module()
    if module is None:
        raise RuntimeError(f"NIXL is not installed here (none of {', '.join(NIXL_MODULES)})")
    trials = warmup + runs
    initiator = 1 if op == NixlOp.READ else 0
    with tempfile.TemporaryDirectory(prefix="kvwire-nixl-") as logs:
        sides = Sides(_side, (work, op, trials, warmup, module, dict(ucx_env or {}), logs), {}, "NIXL")
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
        finally:
            sides.close()
        text = _read(_log_path(logs, initiator))
    for line in notices(text):
        log.warning("NIXL's UCX (side %d): %s", initiator, line)
    times, verified, ticks, _ = results[1]
    sizes = results[initiator][3]
    protocol = chosen(text, UCX_OPERATION[op], sizes) or \
        f"not reported: no UCX_PROTO_INFO table for {UCX_OPERATION[op]} in the initiator's UCX log"
    return NixlResult(times[warmup:], verified, CpuTicks(*ticks), protocol)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
