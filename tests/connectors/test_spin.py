"""A spin yields while something moves and naps once nothing has for its quiet time (connectors/spin.py)."""

from __future__ import annotations

from kvwire.connectors.spin import Spin


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.naps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


def test_yields_while_moving_and_naps_once_quiet():
    clock = _Clock()
    spin = Spin(quiet_s=0.002, nap_s=0.0002, clock=clock, sleep=clock.sleep)
    for _ in range(50):  # moving: every poll yields, however long it goes on
        clock.now += 0.001
        spin.pause(True)
    assert clock.naps == []
    clock.now += 0.001
    spin.pause(False)  # quiet for 1 ms: still within the quiet time
    assert clock.naps == []
    clock.now += 0.0015
    spin.pause(False)  # quiet for 2.5 ms: naps from now on
    spin.pause(False)
    assert clock.naps == [0.0002, 0.0002]
    spin.pause(True)  # something moved again: back to yielding
    assert len(clock.naps) == 2


def test_a_blocking_wait_is_not_a_quiet_spin():
    clock = _Clock()
    spin = Spin(quiet_s=0.002, nap_s=0.0002, clock=clock, sleep=clock.sleep)
    clock.now += 1.0  # the loop blocked for a second, then polls
    spin.reset()
    spin.pause(False)
    assert clock.naps == []
