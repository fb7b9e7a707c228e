"""A self-pipe that lets any thread wake a node loop blocked in zmq.Poller.poll."""

from __future__ import annotations

import os


class Wakeup:
    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)
