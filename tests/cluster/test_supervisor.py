"""The supervisor on its own, with small real child processes: restarts with back-off, clean exits and
stops stay down, --max-restarts gives up, and closing leaves no process behind."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from kvwire.cluster import supervisor as sup
from kvwire.cluster.forked import ForkLauncher
from kvwire.cluster.supervisor import Supervisor
from tests.procs import CTX

PY = (sys.executable, "-c")
SLEEP = "import time; time.sleep(60)"


def run_code(argv: list[str]) -> None:
    """A forked child's entry: run argv[0] as Python, as `python -c` does."""
    exec(argv[0], {"__name__": "__main__"})


def _supervisor(how: str, **kw) -> Supervisor:
    """Children exec'd as `python -c CODE`, or forked from the tests' fork server running CODE."""
    return Supervisor(command=PY, **kw) if how == "exec" else Supervisor(launch=ForkLauncher(CTX, run_code), **kw)


def _wait(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_crashed_child_is_restarted_with_doubling_backoff(monkeypatch):
    monkeypatch.setattr(sup, "BACKOFF_FIRST_S", 0.2)
    lines: list[str] = []
    s = Supervisor(report=lines.append, command=PY)
    try:
        first = s.start("node", ["import sys; sys.exit(3)"]).pid  # crashes at once, every time
        s.start("steady", [SLEEP])
        s.armed.set()
        assert _wait(lambda: s.restarts >= 3)
        deaths = [line for line in lines if "died" in line]
        assert f"node (pid {first}) died (exit status 3); restarting it in 0.2s" in deaths[0]
        assert "restarting it in 0.4s" in deaths[1] and "restarting it in 0.8s" in deaths[2]
        assert any("node restarted (pid" in line for line in lines)
        assert s.procs["steady"].poll() is None and not any("steady" in line for line in lines)
    finally:
        s.close(order=[])


@pytest.mark.parametrize("how", ["exec", "fork"])
def test_clean_exit_and_stop_stay_down_and_a_signal_death_is_named(how):
    lines: list[str] = []
    s = _supervisor(how, report=lines.append)
    try:
        s.start("clean", ["pass"])
        victim = s.start("victim", [SLEEP])
        stopped = s.start("stopped", [SLEEP])
        s.armed.set()
        assert s.stop("stopped") == -signal.SIGTERM and s.is_stopped("stopped")
        victim.send_signal(signal.SIGKILL)
        assert _wait(lambda: s.procs["victim"].pid != victim.pid and s.procs["victim"].poll() is None)
        assert any(f"victim (pid {victim.pid}) died (killed by SIGKILL)" in line for line in lines)
        assert _wait(lambda: s.is_stopped("clean"))
        time.sleep(3 * sup.POLL_S)
        assert s.procs["stopped"].pid == stopped.pid and s.procs["clean"].poll() == 0 and s.restarts == 1
        assert any("clean" in line and "exited with status 0; not restarting it" in line for line in lines)
        assert s.resume("stopped").poll() is None
    finally:
        s.close(order=[])


def test_max_restarts_used_up_gives_up_and_close_leaves_nothing():
    s = Supervisor(max_restarts=1, report=lambda line: None, command=PY)
    crasher = s.start("crasher", ["import sys; sys.exit(1)"])
    s.start("other", [SLEEP])
    s.armed.set()
    assert s.gave_up.wait(10)
    assert s.restarts == 1 and crasher.poll() == 1
    pids = [p.pid for p in s.procs.values()]
    s.close(order=["other"])
    assert not [pid for pid in pids if _alive(pid)]


def test_not_armed_a_crash_is_left_for_the_owner_to_report():
    s = Supervisor(report=lambda line: None, command=PY)
    try:
        proc = s.start("early", ["import sys; sys.exit(2)"])
        assert proc.wait(10) == 2
        time.sleep(3 * sup.POLL_S)
        assert s.restarts == 0 and s.procs["early"] is proc
    finally:
        s.close(order=[])


def test_a_forked_child_writes_to_its_log_and_exits_with_its_status(tmp_path):
    s = _supervisor("fork", log_dir=tmp_path, report=lambda line: None)
    try:
        child = s.start("talker", ["import os, sys; print('out', os.getpid()); print('err', file=sys.stderr); "
                                   "sys.exit(7)"])
        assert child.wait(30) == 7 and child.returncode == 7
        assert sorted((tmp_path / "talker.log").read_text().split()) == sorted(["out", str(child.pid), "err"])
        with pytest.raises(ValueError, match="takes no command"):
            s.start("other", ["pass"], command=PY)
        with pytest.raises(ValueError, match="takes no command"):
            Supervisor(command=PY, launch=ForkLauncher(CTX, run_code))
    finally:
        s.close(order=[])
