"""Keeps a local cluster's children running: the one that dies is restarted, the rest keep serving.

Lifecycle of a supervised child:

1. `start(name, argv)` spawns it (`python -m kvwire.cli.main ARGV`, dying with this process
   through PR_SET_PDEATHSIG; or, given a launcher, whatever it starts for ARGV, such as a fork of a
   preloaded fork server: cluster/forked.py) and remembers its command line.
2. Once the owner has seen the cluster come up and set `armed` (a crash during start-up is
   the owner's to report), the watch thread looks at every child each POLL_S. A child that
   exited without being asked to:
   - with status 0 chose to stop (a node that drained on a SIGTERM sent to it alone): it is
     reported and left down;
   - otherwise crashed: it is reported with its status and restarted with the same command
     line after a back-off (BACKOFF_FIRST_S, doubling up to BACKOFF_MAX_S; back to the first
     once an incarnation has run HEALTHY_RESET_S). A line on stderr tells each death and restart.
   After `max_restarts` restarts in all (None: unlimited) the supervisor gives up: `gave_up`
   is set and the owner (`kvwire up`) stops everything.
3. `stop(name, sig)` stops a child on purpose (SIGTERM, SIGKILL after a grace period): it stays
   down. `close()` stops restarting, then stops every child, then ends the watch thread (the
   children spawned from it would otherwise get their death signal before their SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

POLL_S = 0.1  # a dead child is noticed within this (a child's exit has no event a thread can wait on portably)
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_RESET_S = 60.0
STOP_GRACE_S = 10.0
KVWIRE = (sys.executable, "-m", "kvwire.cli.main")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def describe_exit(returncode: int) -> str:
    """'exit status 3' or 'killed by SIGKILL'."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class ChildProcess(Protocol):
    """What the supervisor and its users do with a child: subprocess.Popen, or cluster/forked.py's ForkedChild."""

    pid: int

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


Launcher = Callable[[list[str], int | None], ChildProcess]  # (argv, output fd or None: inherited) -> started child


@dataclass
class Child:
    name: str
    command: list[str]  # what argv is appended to
    argv: list[str]
    proc: ChildProcess
    started_at: float
    backoff_s: float  # the wait before the next restart
    restart_at: float | None = None  # dead, to be restarted at this time
    stopped: bool = False  # stopped on purpose, or chose to stop: stays down


class Supervisor:
    """Spawns the cluster's children and restarts the ones that crash.

    Args:
        log_dir: each child's output goes to `<log_dir>/<name>.log` (appended across restarts); None: inherited.
        max_restarts: restarts allowed in all before giving up; None: unlimited.
        report: where death and restart lines go (stderr by default).
        command: what a child's ARGV is appended to (`python -m kvwire.cli.main` by default).
        launch: starts a child for its ARGV instead (cluster/forked.py); `command` is then not used, and
            `start` takes none.
    """

    def __init__(self, log_dir: Path | None = None, max_restarts: int | None = None,
                 report: Callable[[str], None] | None = None, command: Sequence[str] | None = None,
                 launch: Launcher | None = None):
        if launch is not None and command is not None:
            raise ValueError("a supervisor with a launcher takes no command: the launcher starts every child")
        self._command = [] if launch is not None else list(KVWIRE if command is None else command)
        self._launch = launch
        self._log_dir = log_dir
        self._max_restarts = max_restarts
        self._report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self._children: dict[str, Child] = {}
        self._lock = threading.Lock()
        self._no_restarts = threading.Event()  # closing: children that die now stay dead
        self._closing = threading.Event()  # the watch thread ends (after the children are stopped)
        self._thread: threading.Thread | None = None
        self.restarts = 0
        self.gave_up = threading.Event()
        self.armed = threading.Event()  # restarts happen only once armed (a crash during start-up is fatal)

    @property
    def procs(self) -> dict[str, ChildProcess]:
        """The current process of each child (a restart replaces it)."""
        with self._lock:
            return {name: c.proc for name, c in self._children.items()}

    def start(self, name: str, argv: list[str], command: Sequence[str] | None = None) -> ChildProcess:
        """Spawn `python -m kvwire.cli.main ARGV` (or COMMAND ARGV; the supervisor's command by default) as
        child `name`, replacing a stopped one of that name."""
        if command is not None and self._launch is not None:
            raise ValueError(f"{name}: this supervisor's launcher starts every child; it takes no command")
        cmd = list(self._command if command is None else command)
        with self._lock:
            old = self._children.get(name)
            assert old is None or old.proc.poll() is not None, f"{name} is running"
            child = Child(name, cmd, argv, self._spawn(name, cmd + argv), time.monotonic(), BACKOFF_FIRST_S)
            self._children[name] = child
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="kvwire-supervisor", daemon=True)
            self._thread.start()
        return child.proc

    def _spawn(self, name: str, args: list[str]) -> ChildProcess:
        out = None
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self._log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            if self._launch is not None:
                return self._launch(args, None if out is None else out.fileno())
            return subprocess.Popen(args, stdout=out,
                                    stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent, cwd=os.getcwd())
        finally:
            if out is not None:
                out.close()

    def _watch(self) -> None:
        while not self._closing.wait(POLL_S):
            with self._lock:
                for child in self._children.values():
                    self._look_at(child)

    def _look_at(self, child: Child) -> None:
        if child.stopped or self._no_restarts.is_set() or not self.armed.is_set():
            return
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._restart(child, now)
            return
        code = child.proc.poll()
        if code is None:
            return
        if code == 0:
            child.stopped = True
            self._report(f"kvwire: {child.name} (pid {child.proc.pid}) exited with status 0; not restarting it")
            return
        if now - child.started_at >= HEALTHY_RESET_S:
            child.backoff_s = BACKOFF_FIRST_S
        if self._max_restarts is not None and self.restarts >= self._max_restarts:
            self._report(f"kvwire: {child.name} (pid {child.proc.pid}) died ({describe_exit(code)}); "
                         f"{self.restarts} restarts used of --max-restarts {self._max_restarts}: giving up")
            self.gave_up.set()
            return
        child.restart_at = now + child.backoff_s
        self._report(f"kvwire: {child.name} (pid {child.proc.pid}) died ({describe_exit(code)}); "
                     f"restarting it in {child.backoff_s:.1f}s")

    def _restart(self, child: Child, now: float) -> None:
        child.restart_at = None
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
        self.restarts += 1
        try:
            child.proc = self._spawn(child.name, child.command + child.argv)
        except OSError as exc:
            child.restart_at = now + child.backoff_s
            self._report(f"kvwire: restarting {child.name} failed ({exc}); trying again in {child.backoff_s:.1f}s")
            return
        child.started_at = now
        self._report(f"kvwire: {child.name} restarted (pid {child.proc.pid}, restart {self.restarts})")

    def is_stopped(self, name: str) -> bool:
        """Whether child `name` is down for good (stopped on purpose, or exited cleanly) until `resume`."""
        with self._lock:
            return self._children[name].stopped

    def resume(self, name: str) -> ChildProcess:
        """Start child `name` again with its command line, after `stop` (or a clean exit) left it down."""
        with self._lock:
            child = self._children[name]
            assert child.stopped and child.proc.poll() is not None, f"{name} is running or being restarted"
            child.proc = self._spawn(name, child.command + child.argv)
            child.started_at, child.stopped = time.monotonic(), False
            return child.proc

    def stop(self, name: str, sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> int | None:
        """Stop child `name` on purpose (it stays down); its exit status, None if there is no such child."""
        with self._lock:
            child = self._children.get(name)
            if child is None:
                return None
            child.stopped = True
            child.restart_at = None
            proc = child.proc
        if proc.poll() is not None:
            return proc.returncode
        proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        proc.send_signal(sig)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self, order: list[str]) -> None:
        """Stop restarting, stop every child (those named in `order` first), then end the watch thread."""
        self._no_restarts.set()
        names = [n for n in order if n in self._children] + [n for n in self._children if n not in order]
        for name in names:
            self.stop(name)
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
