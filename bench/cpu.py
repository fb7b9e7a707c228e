"""Where the machine's CPU went while a method's measured transfers ran (all cores, /proc/stat).

A transfer between two processes on one host is bounded by the cores as much as by memory:
both sides copy, poll and make system calls on the same cores. `CpuTally` adds up the
host-wide CPU time spent inside each timed interval (`with tally:` around the transfer),
split into user, kernel (system, irq, softirq) and steal (a VM's hypervisor took the core).
A method that keeps every core busy, mostly in the kernel, is bound by the kernel's copies;
one that leaves cores idle is waiting on something else. The counters tick 100 times a
second per core, so only the sum over a row's runs means much. Linux only; elsewhere the
tally stays empty and the row shows no shares.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import msgspec

_STAT = "/proc/stat"


class CpuTicks(NamedTuple):
    user: int  # user + nice
    kernel: int  # system + irq + softirq
    steal: int
    total: int  # every state, idle and iowait included


def read_ticks() -> CpuTicks | None:
    """The host's CPU counters now, summed over cores; None where /proc/stat is not there."""
    try:
        with open(_STAT, "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return CpuTicks(user + nice, system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq
                    + steal)


class CpuShares(msgspec.Struct, frozen=True):
    """Fractions of all the host's core time inside the measured intervals."""

    busy: float  # user + kernel
    kernel: float
    steal: float


class CpuTally:
    """Host-wide CPU ticks spent inside `with` blocks; picklable counts travel between processes."""

    def __init__(self) -> None:
        self.ticks = CpuTicks(0, 0, 0, 0)
        self._start: CpuTicks | None = None

    @classmethod
    def of(cls, ticks: CpuTicks) -> CpuTally:
        tally = cls()
        tally.add(ticks)
        return tally

    def counting(self, on: bool) -> contextlib.AbstractContextManager:
        """This tally as a `with` block when `on` (a measured run), else a block that counts nothing (warm-up)."""
        return self if on else contextlib.nullcontext()

    def __enter__(self) -> CpuTally:
        self._start = read_ticks()
        return self

    def __exit__(self, *exc) -> None:
        end, start = read_ticks(), self._start
        if start is not None and end is not None:
            self.add(CpuTicks(*(e - s for e, s in zip(end, start))))

    def add(self, ticks: CpuTicks) -> None:
        self.ticks = CpuTicks(*(a + b for a, b in zip(self.ticks, ticks)))

    def shares(self) -> CpuShares | None:
        t = self.ticks
        if t.total <= 0:
            return None
        return CpuShares(busy=round((t.user + t.kernel) / t.total, 3), kernel=round(t.kernel / t.total, 3),
                         steal=round(t.steal / t.total, 3))
