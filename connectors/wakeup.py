"""A self-pipe that lets any thread wake a node loop blocked in zmq.Poller.poll, and a mailbox over it."""

from __future__ import annotations

import os
import queue
from typing import Generic, TypeVar

T = TypeVar("T")


class Wakeup:
    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        """Safe from any thread or signal handler, also after close() (a late signal during shutdown)."""
        w = self._w
        if w < 0:
            return
        try:
            os.write(w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending
        except OSError:
            pass  # closed meanwhile: nobody is left to wake

    @property
    def write_fd(self) -> int:
        """The end `wake` writes to (non-blocking), for `signal.set_wakeup_fd`: a signal wakes the loop
        whichever thread the kernel hands it to."""
        return self._w

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        w, self._w = self._w, -1
        if w >= 0:
            os.close(self.fd)
            os.close(w)


class Mailbox(Generic[T]):
    """What other threads tell a loop: each item queued and the loop's `wakeup` woken; the loop takes them
    all at once, on its own thread (`take`). Given no wakeup, it makes its own and closes it in `close`."""

    def __init__(self, wakeup: Wakeup | None = None) -> None:
        self._owns_wakeup = wakeup is None
        self.wakeup = wakeup or Wakeup()
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()

    def put(self, item: T) -> None:
        """Any thread."""
        self._items.put(item)
        self.wakeup.wake()

    def take(self) -> list[T]:
        """Everything put since the last call, in order."""
        out = []
        while not self._items.empty():
            out.append(self._items.get())
        return out

    def close(self) -> None:
        if self._owns_wakeup:
            self.wakeup.close()
