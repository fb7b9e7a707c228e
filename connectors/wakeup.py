"""A self-pipe that lets any thread wake a node loop blocked in zmq.Poller.poll."""

from __future__ import annotations

import os


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
