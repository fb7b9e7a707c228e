"""The bench's host CPU tally: a spinning block shows busy cores, a sleeping one does not."""

from __future__ import annotations

import os
import time

import pytest

from kvwire.bench.cpu import CpuTally, CpuTicks, read_ticks

pytestmark = pytest.mark.skipif(read_ticks() is None, reason="no /proc/stat")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_spinning_shows_a_busy_core_and_sleeping_an_idle_host():
    cores = os.cpu_count() or 1
    spun, slept = CpuTally(), CpuTally()
    for _ in range(3):  # alternate, so a neighbour's burst weighs on both
        with spun:
            _spin(0.2)
        with slept:
            time.sleep(0.2)
    busy, idle = spun.shares(), slept.shares()
    assert busy is not None and idle is not None
    assert busy.busy >= 0.8 / cores  # this thread alone keeps one core busy
    # Host-wide: with other processes saturating every core, the sleeping windows read all busy too.
    assert busy.busy > idle.busy or idle.busy >= 0.99
    assert 0 <= busy.kernel <= busy.busy <= 1 and 0 <= busy.steal <= 1


def test_an_empty_tally_has_no_shares_and_tallies_add_up():
    assert CpuTally().shares() is None
    tally = CpuTally()
    tally.add(CpuTicks(user=30, kernel=10, steal=0, total=100))
    tally.add(CpuTicks(user=10, kernel=30, steal=20, total=100))
    shares = tally.shares()
    assert (shares.busy, shares.kernel, shares.steal) == (0.4, 0.2, 0.1)
