"""One two-host topology and one cluster on it for every test here; the fault matrix at the end."""

from __future__ import annotations

import pytest

from kvwire.connectors.config import ConnectorKind
from tests.netns.cluster import NetnsCluster
from tests.netns.matrix import MATRIX, table
from tests.netns.topology import NetnsUnavailable, Topology


@pytest.fixture(scope="session")
def topology():
    try:
        topo = Topology.create()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield topo
    finally:
        topo.remove()


@pytest.fixture(scope="session")
def netns_cluster(topology, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("netns-logs")
    cluster = NetnsCluster(topology, tiny_model_dir, logs).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        print(f"\nnetns cluster logs: {logs}")


@pytest.fixture(scope="session", params=[ConnectorKind.TCP, ConnectorKind.UCX, ConnectorKind.NCCL, ConnectorKind.AUTO],
                ids=str)
def connector(request) -> ConnectorKind:
    """Every test here runs over each connector. Session-scoped: pytest runs every test of both modules over one
    connector before the next, so the nodes restart once per connector."""
    return request.param


@pytest.fixture
def cluster(netns_cluster: NetnsCluster, connector: ConnectorKind) -> NetnsCluster:
    """The shared cluster with both nodes up over `connector` (restarted only when they are not)."""
    cluster = netns_cluster
    alive = all(r in cluster.procs and cluster.procs[r].poll() is None for r in ("prefill", "decode"))
    if cluster.connector != connector or not alive:
        cluster.start_nodes(connector)
    cluster.topo.data_link(True)  # a test that failed half-way may have left a fault in
    return cluster


def pytest_terminal_summary(terminalreporter):
    if MATRIX:
        terminalreporter.write_line("two-host fault matrix (tests/netns):")
        for line in table():
            terminalreporter.write_line(line)
