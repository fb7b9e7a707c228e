"""bench/sides.py: the two spawned sides of a peer's bench get the settings they are given, in real processes."""

from __future__ import annotations

import os

from kvwire.bench.sides import Sides


def _report_env(side: int, pipe) -> None:
    pipe.send((side, os.environ.get("KVWIRE_BENCH_GIVEN"), os.environ.get("KVWIRE_BENCH_DROPPED")))


def test_each_side_runs_with_the_env_it_was_given_not_the_fork_servers(monkeypatch):
    # the fork server's children inherit the environment it started with: `env` must be applied in the child
    Sides(_report_env, (), {}, "env").close()  # the fork server is running before the bench's env changes
    monkeypatch.setenv("KVWIRE_BENCH_DROPPED", "the bench's")
    sides = Sides(_report_env, (), {"KVWIRE_BENCH_GIVEN": "tcp", "KVWIRE_BENCH_DROPPED": None}, "env")
    try:
        assert [sides.recv(0), sides.recv(1)] == [(0, "tcp", None), (1, "tcp", None)]
    finally:
        sides.close()
