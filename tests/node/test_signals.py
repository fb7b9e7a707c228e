"""A node's loop ends on SIGTERM at once, whichever of its threads the kernel hands the signal to.

Python runs a signal's handler on the main thread, and only once that thread runs Python again; a node's
loop sleeps in a poll with a long timeout. The kernel may deliver a process-directed SIGTERM to any thread
that does not block it (seen: forked node processes that kept serving for 10 s, until SIGKILL). Here the
signal is sent to a helper thread on purpose (pthread_kill), in a process of its own.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import zmq

from kvwire.connectors.wakeup import Wakeup
from kvwire.node.runtime import serve_until_signalled
from tests.procs import CTX

LOOP_SLEEP_MS = 30_000  # the loop's poll timeout: far past what the test waits


class SleepyNode:
    """The part of a node serve_until_signalled drives: a loop asleep on its wakeup fd until stopped."""

    def __init__(self) -> None:
        self.rt = SimpleNamespace(config=SimpleNamespace(node_id="sleepy"))
        self._wakeup = Wakeup()
        self.closed = False

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while not stop.is_set():
            poller.poll(LOOP_SLEEP_MS)
            self._wakeup.drain()

    def wake(self) -> None:
        self._wakeup.wake()

    @property
    def wakeup_fd(self) -> int:
        return self._wakeup.write_fd

    def close(self) -> None:
        self._wakeup.close()


def _serve_then_signal_a_helper_thread(out) -> None:
    node = SleepyNode()
    helper = threading.Thread(target=lambda: (time.sleep(0.3), signal.pthread_kill(threading.get_ident(),
                                                                                 signal.SIGTERM)))
    start = time.monotonic()
    helper.start()
    serve_until_signalled(node)  # type: ignore[arg-type]  # a Node as far as this function looks
    out.put(time.monotonic() - start)
    helper.join()


def test_sigterm_caught_on_another_thread_ends_the_loop_at_once():
    out = CTX.Queue()
    proc = CTX.Process(target=_serve_then_signal_a_helper_thread, args=(out,))
    proc.start()
    try:
        took = out.get(timeout=20)
        proc.join(10)
        assert proc.exitcode == 0 and 0.3 <= took < 5.0, (proc.exitcode, took)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
