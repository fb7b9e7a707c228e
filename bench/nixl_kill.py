"""The peer's row of the dead-producer repro: a NIXL producer SIGKILLed while its reader READs its pool.

kvwire's own repro (tests/connectors/transports/ucx/test_dead_producer.py, docs/BENCHMARKS.md) kills a UCX producer
0-30 ms into a pull and asks whether the consumer's process lives and its pull fails within its deadline. Here the
same kill meets NIXL, driven as bench/nixl_run.py drives it (UCX backend, DRAM, one prepared READ over every piece
of a 2,048-token Llama-3-8B request, 256 MiB): each trial starts both sides in fresh processes, kills the producer a
random 0-30 ms after the reader's `transfer`, and records how the reader ended: its transfer DONE or ERR, still
pending at the deadline, or its process dead (exit -6: SIGABRT).

`python -m kvwire.bench.nixl_kill --trials 30 --busy 2` (two busy loops beside it, as the issue's load).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import signal
import time

from kvwire.bench.choices import Placement
from kvwire.bench.nixl_run import _agent, nixl_module
from kvwire.bench.workload import Workload, allocate_pool, fill_random, piece_table
from kvwire.connectors.transports.kv_region import KVRegion

CTX = mp.get_context("spawn")
DEADLINE_S = 10.0  # how long the reader polls its transfer after the kill


def _producer(work: Workload, pipe) -> None:
    module = nixl_module()
    assert module is not None  # main() checked
    region = KVRegion.from_kv_caches(allocate_pool(work))
    fill_random(region)
    agent = _agent(module, "kill-producer", region, "DRAM")
    pipe.send((agent.get_agent_metadata(), piece_table(region, work.runs(0))))
    while True:  # serve until killed (the target's worker needs no progress for a READ over cma/sysv)
        agent.get_new_notifs()
        time.sleep(0.001)


def _reader(work: Workload, pipe) -> None:
    import numpy as np

    module = nixl_module()
    assert module is not None  # main() checked
    region = KVRegion.from_kv_caches(allocate_pool(work))
    agent = _agent(module, "kill-reader", region, "DRAM")
    meta, theirs = pipe.recv()
    peer = agent.add_remote_agent(meta)
    mine = piece_table(region, work.runs(1))
    local, remote = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mine, "DRAM"), agent.prep_xfer_dlist(peer, theirs, "DRAM")
    idx = np.arange(len(mine), dtype=np.int32)
    handle = agent.make_prepped_xfer("READ", local, idx, remote, idx, b"done")
    pipe.send("reading")
    start = time.monotonic()
    call = "transfer"
    try:
        state = agent.transfer(handle)
        call = "check_xfer_state"
        while state not in ("DONE", "ERR") and time.monotonic() - start < DEADLINE_S:
            state = agent.check_xfer_state(handle)
    except Exception as exc:  # NIXL's own errors (nixlRemoteDisconnectError, ...): a typed failure, reported
        state = f"raised {type(exc).__name__} from {call}"
    pipe.send((state if state in ("DONE", "ERR") or state.startswith("raised") else "pending",
               time.monotonic() - start))


def trial(work: Workload, kill_after_s: float) -> tuple[str, float | None]:
    """One kill; how the reader ended: DONE, ERR, raised (NIXL's exception), pending (still, at DEADLINE_S), or
    died (exit code), with the seconds from its `transfer` to that end."""
    p_parent, p_child = CTX.Pipe()
    r_parent, r_child = CTX.Pipe()
    producer = CTX.Process(target=_producer, args=(work, p_child), daemon=True)
    reader = CTX.Process(target=_reader, args=(work, r_child), daemon=True)
    producer.start()
    reader.start()
    try:
        r_parent.send(p_parent.recv())
        assert r_parent.poll(60) and r_parent.recv() == "reading"
        time.sleep(kill_after_s)
        assert producer.pid is not None  # started
        os.kill(producer.pid, signal.SIGKILL)
        if r_parent.poll(DEADLINE_S + 10):
            state, seconds = r_parent.recv()
            early = state == "DONE" and seconds < kill_after_s
            return state + (" (finished before the kill)" if early else ""), seconds
        reader.join(5)
        return (f"died (exit {reader.exitcode})" if reader.exitcode is not None else "hung"), None
    except EOFError:
        reader.join(5)
        return f"died (exit {reader.exitcode})", None
    finally:
        for proc in (reader, producer):
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def _busy() -> None:
    while True:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--busy", type=int, default=0, help="busy loops beside the trials")
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args()
    if nixl_module() is None:
        raise SystemExit("NIXL is not installed here (pip install 'kvwire[bench]')")
    work = Workload(args.tokens, Placement.SCATTERED)
    loops = [CTX.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for loop in loops:
        loop.start()
    outcomes: collections.Counter[str] = collections.Counter()
    rng = random.Random(0)
    try:
        for i in range(args.trials):
            kill_ms = rng.uniform(0, 30)
            outcome, seconds = trial(work, kill_ms / 1000)
            outcomes[outcome] += 1
            took = "" if seconds is None else f" {seconds:.3f} s after its transfer began"
            print(f"trial {i + 1:2d}: producer killed {kill_ms:4.1f} ms into the READ: reader {outcome}{took}",
                  flush=True)
    finally:
        for loop in loops:
            loop.kill()
    print("outcomes:", ", ".join(f"{k} x{v}" for k, v in outcomes.most_common()))


if __name__ == "__main__":
    main()
