"""The self-pipe wake-up: wakes a poller, and stays harmless after close (a late signal during shutdown)."""

from __future__ import annotations

import select

from kvwire.connectors.wakeup import Wakeup


def test_wake_makes_the_fd_readable_and_drain_clears_it():
    w = Wakeup()
    try:
        assert select.select([w.fd], [], [], 0)[0] == []
        w.wake()
        w.wake()
        assert select.select([w.fd], [], [], 0)[0] == [w.fd]
        w.drain()
        assert select.select([w.fd], [], [], 0)[0] == []
    finally:
        w.close()


def test_wake_and_close_after_close_do_nothing():
    w = Wakeup()
    w.close()
    w.wake()  # a SIGTERM handler firing after the node closed used to raise EBADF here
    w.close()
