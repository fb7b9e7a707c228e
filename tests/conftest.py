"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvwire.cluster.redis_server import LocalRedis

# The suite's own computations (the in-process reference generations) run on one thread, as every node it
# starts does (--torch-threads 1). With intra-op threads, two busy loops on this 2-core machine made them
# crawl: test_up_supervision's reference took about 4 minutes instead of a few seconds (OpenMP's workers
# spinning against the busy cores), and the fault tests are run under such loads.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One private redis-server for the session (tests that crash a server start their own)."""
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    """The session server's URL, its database emptied before the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny checkpoint (seed 0), written once per session."""
    from kvwire.engine.init_model import write_random_checkpoint

    path = tmp_path_factory.mktemp("models") / "tiny"
    write_random_checkpoint(path, "tiny", 0)
    return path


def pytest_addoption(parser):
    parser.addoption("--connector", action="append", default=None,
                     help="Run connector tests for this connector only (repeatable); all registered ones by default.")


def pytest_generate_tests(metafunc):
    if "connector_kind" in metafunc.fixturenames:
        from kvwire.connectors.config import ConnectorKind
        from kvwire.connectors.factory import available_transports

        chosen = metafunc.config.getoption("--connector") or available_transports()
        metafunc.parametrize("connector_kind", [ConnectorKind(c) for c in chosen], ids=str)
