"""A reproducer for the prefill crash in README's Known limits: UCX 1.21 over TCP, pulls coming and going while
the data link between two hosts is cut and healed. It runs until the producer dies or the time is up.

    .venv/bin/python -m tests.netns.ucx_stress [--minutes 10] [--consumers 1] [--seed 2]

It needs root (it builds tests/netns's two-host topology).

- The producer (namespace A) is kvwire's UCXSendEngine. Consumers ask it for pulls over a unix socket. It starts
  each pull after a random delay, as a prefill still computing would, and abandons a pull at its deadline, as
  the transfer server does.
- Each consumer (namespace B) pulls like UCXPuller: connect, ask, post, then wait until its deadline. After a
  failure it stops and fences its lanes.
- The data link is shaped to 50 Mbit/s, so that a cut lands mid-pull. It is cut and healed at random.

It prints the producer's exit code (-11: SIGSEGV). A core goes where kernel.core_pattern says. Seen with UCX 1.21
and the code of e067a84: 1 crash in 4 runs, 45 minutes in all (`uct_tcp_iface_handle_events` called for a freed
TCP endpoint: UCX destroyed it in its read handler and then ran its write handler, README Known limits). Since
the send engine parks a stuck pull's TCP endpoints rather than force-closing them (worker.py `park`), the
producer should outlive it: a crash now is a regression.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCKS = 16  # one pull: 16 blocks of 128 KiB, one piece each (packed on every other pull)
PULL_DEADLINE_S = 1.0  # the consumer's
SEND_DEADLINE_S = 2.0  # the producer's, once a pull has started
MAX_START_DELAY_S = 1.5  # past the consumer's deadline: some pulls start for a consumer that has fenced already
REPORT_S = 5.0


def _region():
    from kvwire.connectors.kv_pool import KVPool
    from kvwire.connectors.transports.kv_region import KVRegion
    from kvwire.connectors.wire import DType, KVLayout

    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=DType.FLOAT32)
    return KVRegion.from_kv_caches(KVPool.allocate(layout, BLOCKS).kv_caches)


RUNS = [(i, 1) for i in range(BLOCKS)]


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    (n,) = struct.unpack("!I", exactly(4))
    return exactly(n)


@dataclass
class _Held:
    hidden: list = field(default_factory=list)
    gate: None = None


class _Claims:
    def __init__(self) -> None:
        self.finished: list = []

    def claim(self, msg, identity=b""):
        raise AssertionError("the engine takes no pulls itself")

    def finish(self, job, error, settling=False) -> None:
        self.finished.append((job, error))

    def settled(self, job) -> None:
        pass  # the region is never reused here: nothing waits for a pull's blocks


def producer(path: str, seed: int) -> None:
    """Serve pulls asked on the unix socket at `path`; its UCX address goes to `path`.addr."""
    from kvwire.connectors.transports.transport import SendJob
    from kvwire.connectors.transports.ucx.send_engine import UCXSendEngine
    from kvwire.connectors.wire import PullRequest

    region, rng = _region(), random.Random(seed)
    engine = UCXSendEngine()
    engine.bind(claims := _Claims())
    Path(path + ".addr.tmp").write_bytes(engine.transport_address)
    os.rename(path + ".addr.tmp", path + ".addr")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)
    conns: list[socket.socket] = []
    waiting: list[tuple[float, PullRequest]] = []
    active: list = []
    tally = {"ok": 0, "failed": 0, "abandoned": 0, "refused": 0}
    reported = time.monotonic()
    while True:
        engine.progress()
        for job, error in claims.finished:
            active.remove(job)
            tally["ok" if error is None else "failed"] += 1
        claims.finished.clear()
        now = time.monotonic()
        for job in [j for j in active if j.deadline <= now]:
            engine.abandon(job)
            active.remove(job)
            tally["abandoned"] += 1
        for sock in select.select([server, *conns], [], [], 0)[0]:
            if sock is server:
                conns.append(server.accept()[0])
                continue
            try:
                data = _recv(sock)
            except (EOFError, OSError):
                conns.remove(sock)
                continue
            transfer_id, pack_below = struct.unpack("!QI", data[:12])
            waiting.append((now + rng.uniform(0, MAX_START_DELAY_S), PullRequest(
                request_id=f"r{transfer_id}", transfer_id=transfer_id, consumer="c", transport_address=data[12:],
                dst_block_ids=list(range(BLOCKS)), guarded=True, pack_below=pack_below)))
        for item in [w for w in waiting if w[0] <= now]:
            waiting.remove(item)
            job = SendJob(b"", item[1], _Held(), region, RUNS, now + SEND_DEADLINE_S)
            try:
                engine.start(job)
            except Exception:  # noqa: BLE001 - UCX's own errors (unreachable): refused, as the transfer server does
                tally["refused"] += 1
                continue
            active.append(job)
        if now - reported > REPORT_S:
            print("producer", tally, flush=True)
            reported = now
        time.sleep(0.0002)


def consumer(path: str) -> None:
    """Pull again and again from the producer whose socket is at `path`."""
    from kvwire.connectors.transports.ucx.lanes import ReceiveLanes
    from kvwire.connectors.transports.ucx.packing import PACK_BELOW

    parts = _region().parts(RUNS)
    address = Path(path + ".addr").read_bytes()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    lanes, tally, reported = ReceiveLanes(1), {"ok": 0, "failed": 0}, time.monotonic()
    for transfer_id in range(1, 1 << 62):
        pack_below = PACK_BELOW if transfer_id % 2 else 0
        try:
            lanes.connect(address)
            _send(sock, struct.pack("!QI", transfer_id, pack_below) + lanes.address)
            lanes.post(address, parts, transfer_id, pack_below)
            end = time.monotonic() + PULL_DEADLINE_S
            while not lanes.done():
                if time.monotonic() > end:
                    raise TimeoutError("pull deadline")
                lanes.progress()
            lanes.check_errors()
            lanes.flush()
            tally["ok"] += 1
        except Exception:  # noqa: BLE001 - any failure: stop and fence, as UCXPuller does
            tally["failed"] += 1
            lanes.stop(address)
            old, lanes = lanes, ReceiveLanes(1)
            old.close()
            time.sleep(0.05)
        if time.monotonic() - reported > REPORT_S:
            print("consumer", tally, flush=True)
            reported = time.monotonic()


def control(minutes: float, consumers: int, seed: int, log_dir: Path) -> int | None:
    """Run the producer and the consumers in the topology, cutting the data link; returns the producer's exit
    code (None: it lived)."""
    from tests.netns.topology import Topology

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the topology is removed on the way out
    topo, rng = Topology.create(), random.Random(seed)
    path, me = str(log_dir / "pulls.sock"), [sys.executable, "-m", "tests.netns.ucx_stress"]
    procs: list[subprocess.Popen] = []
    try:
        topo.shape_data("50mbit")
        procs.append(subprocess.Popen([*topo.a.exec_prefix(), *me, "--role", "producer", "--path", path,
                                       "--seed", str(seed)], stdout=open(log_dir / "producer.log", "w"),
                                      stderr=subprocess.STDOUT))
        while not os.path.exists(path + ".addr"):
            if procs[0].poll() is not None:
                raise RuntimeError(f"the producer exited with {procs[0].returncode} (log: {log_dir})")
            time.sleep(0.1)
        for k in range(consumers):
            procs.append(subprocess.Popen([*topo.b.exec_prefix(), *me, "--role", "consumer", "--path", path],
                                          stdout=open(log_dir / f"consumer{k}.log", "w"), stderr=subprocess.STDOUT))
        end, cuts = time.monotonic() + 60 * minutes, 0
        while time.monotonic() < end and all(p.poll() is None for p in procs):
            time.sleep(rng.uniform(0.3, 2.0))
            topo.data_link(False)
            cuts += 1
            time.sleep(rng.uniform(0.2, 3.0))
            topo.data_link(True)
        print(f"{cuts} cuts; producer exit code {procs[0].poll()}; consumers "
              f"{[p.poll() for p in procs[1:]]}; logs in {log_dir}")
        return procs[0].poll()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        topo.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--role", choices=["control", "producer", "consumer"], default="control")
    parser.add_argument("--path", default="")
    args = parser.parse_args()
    if args.role == "producer":
        producer(args.path, args.seed)
    elif args.role == "consumer":
        consumer(args.path)
    else:
        log_dir = Path(f"/tmp/kvwire-ucx-stress-{os.getpid()}")
        log_dir.mkdir()
        code = control(args.minutes, args.consumers, args.seed, log_dir)
        sys.exit(0 if code is None else 1)


if __name__ == "__main__":
    main()
