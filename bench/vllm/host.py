"""How busy the host was with work that is not the bench's, while a setup was measured (Linux).

The bench's own processes are this process and every descendant (servers, their engine and
worker processes, the router, Redis). `ForeignLoad.start()` notes the host's busy CPU time
(/proc/stat) and theirs (/proc/PID/stat); `stop()` returns the difference as cores: about 0
on a quiet host, 1.0 when something else kept one core busy the whole time. Where /proc is
missing it returns None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK")


def _host_busy_ticks() -> int:
    # cpu  user nice system idle iowait irq softirq steal ...: busy is everything but idle, iowait and steal
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6]


def _tree_busy_ticks(root: int) -> int:
    """utime + stime of `root` and every process descending from it."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        parent[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    ours = {root}
    while grown := {pid for pid, pp in parent.items() if pp in ours} - ours:
        ours |= grown
    return sum(ticks.get(pid, 0) for pid in ours)


class ForeignLoad:
    """Cores kept busy by processes other than this one's tree, between `start()` and `stop()`."""

    def __init__(self) -> None:
        self._start: tuple[float, int, int] | None = None

    def start(self) -> None:
        if Path("/proc/stat").exists():
            self._start = (time.monotonic(), _host_busy_ticks(), _tree_busy_ticks(os.getpid()))

    def stop(self) -> float | None:
        """The other processes' CPU time over the wall time, in cores; None where /proc is missing."""
        if self._start is None:
            return None
        t0, host0, ours0 = self._start
        elapsed = time.monotonic() - t0
        foreign = (_host_busy_ticks() - host0) - (_tree_busy_ticks(os.getpid()) - ours0)
        return round(max(0.0, foreign / _HZ / max(elapsed, 1e-3)), 2)
