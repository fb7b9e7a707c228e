"""free_port: ports below the ephemeral range that nothing listens on, never the same one twice in a while."""

from __future__ import annotations

import random
import socket

from kvwire.cluster import ports


class _Unbound:
    """A socket whose bind always succeeds: whatever else listens on this machine, the draws alone decide."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def bind(self, address) -> None:
        pass


def test_ports_picked_before_any_is_bound_are_distinct_even_when_the_draws_repeat(monkeypatch):
    draws = iter([21000, 21000, 21000, 21001, 21000, 21002])  # the draws a test's three servers might get
    monkeypatch.setattr(random, "randrange", lambda lo, hi: next(draws))
    monkeypatch.setattr(ports.socket, "socket", _Unbound)
    monkeypatch.setattr(ports, "_given", {})
    assert [ports.free_port() for _ in range(3)] == [21000, 21001, 21002]


def test_a_port_something_listens_on_is_not_handed_out(monkeypatch):
    """The first draw is a port something listens on; the draws after it are real ones (the port after `taken`
    is in the kernel's ephemeral range, where another connection on a busy machine may hold it)."""
    real_randrange = random.randrange
    draws: list[int] = []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]

        def draw(lo: int, hi: int) -> int:
            draws.append(taken if not draws else real_randrange(lo, hi))
            return draws[-1]

        monkeypatch.setattr(random, "randrange", draw)
        monkeypatch.setattr(ports, "_given", {})
        port = ports.free_port()
    assert draws[0] == taken and port != taken
    assert port in draws[1:]
