"""Children forked from a fork server that imported their code once, for a supervisor (cluster/supervisor.py).

A node process started as `python -m kvwire.cli.main prefill ...` spends a second or two of a core importing
torch and kvwire before it does anything. Tests and benches start dozens of clusters; `ForkLauncher` starts
each child from multiprocessing's fork server instead, which imported those modules once (its preload): the
child is still its own process, with its own sockets, model, transport and threads, running the same entry
point with the same arguments. What differs, and why `kvwire up` keeps exec'ing: the child's parent is the fork
server (it dies with it: PR_SET_PDEATHSIG), and `ps` shows the fork server's command line, not the child's.

Lifecycle of a `ForkedChild`: `ForkLauncher(ctx, entry)(argv, out)` forks it and runs `entry(argv)` in it with
stdout and stderr on `out` (or on the launching process's own at that moment); `poll()`/`wait()` read its
exit status (a negative signal number when killed, as subprocess.Popen gives); every one still running when
the launching process exits is killed then, so a leaked one does not hold that exit up.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import weakref
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from multiprocessing.reduction import DupFd

Entry = Callable[[list[str]], object]  # runs a child's argv, e.g. the kvwire CLI


class ForkedChild:
    """A child forked by the fork server: the part of subprocess.Popen a supervisor and its users need."""

    def __init__(self, ctx: ForkServerContext, entry: Entry, argv: list[str], out: int | None):
        self.args = list(argv)
        fds = (out, out) if out is not None else (1, 2)
        self._proc = ctx.Process(target=_child_main, args=(entry, self.args, _Fd(fds[0]), _Fd(fds[1])),
                                 name=f"kvwire {' '.join(argv[:1])}")
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid
        _LIVE.add(self)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        _LIVE.discard(self)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkLauncher:
    """Starts a supervisor's children as `entry(argv)` forked from `ctx`'s fork server.

    Args:
        ctx: a fork-server context whose preload holds what `entry` imports (set before its first child).
        entry: a module-level function (it travels by reference) that runs one child's argv and returns or
            raises SystemExit when the child is done.
    """

    def __init__(self, ctx: ForkServerContext, entry: Entry):
        self._ctx, self._entry = ctx, entry

    def __call__(self, argv: list[str], out: int | None) -> ForkedChild:
        return ForkedChild(self._ctx, self._entry, argv, out)


class _Fd:
    """A descriptor of this process that the fork server hands to the child (duplicated while it starts)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _same, (DupFd(self.fd),)  # pickled inside Process.start, where the fork server's popen is known


def _same(x):
    return x


def _child_main(entry: Entry, argv: list[str], out, err) -> None:
    """In the child: die with the fork server, write where the launcher said, run the entry."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        os.dup2(fd, target)
        os.close(fd)
    entry(argv)


_LIVE: weakref.WeakSet[ForkedChild] = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's own exit hook, so it runs first: that one joins children
def _kill_leftovers() -> None:
    for child in list(_LIVE):
        child.kill()
        try:
            child.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
