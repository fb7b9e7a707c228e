"""One TCP cluster for every fault test (starting one costs more than the faults do), and the totals."""

from __future__ import annotations

import signal

import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind
from tests.faults.harness import BS, KV_DEADLINE_S, REQUEST_TIMEOUT_S, Tally, wait_restarted
from tests.procs import FORK

TOTALS = Tally()


@pytest.fixture(scope="session")
def fault_cluster(tiny_model_dir, tmp_path_factory):
    """prefill + decode + router over TCP (shm would collide with other runs on this host), short deadlines."""
    logs = tmp_path_factory.mktemp("fault-logs")
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.TCP, block_size=BS, num_blocks=256,
                       kv_deadline_s=KV_DEADLINE_S, log_dir=logs, request_timeout_s=REQUEST_TIMEOUT_S, launch=FORK)
    with LocalCluster(spec) as cluster:
        yield cluster
    print(f"\nfault cluster logs: {logs}")


@pytest.fixture
def cluster(fault_cluster):
    """The shared cluster, every process running and ready (the supervisor restarts crashed ones; a test that
    failed half-way may have left one stopped or stopped-and-continued)."""
    for name, proc in fault_cluster.procs.items():
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        else:
            if fault_cluster.supervisor.is_stopped(name):
                fault_cluster.supervisor.resume(name)
            wait_restarted(fault_cluster, name, proc.pid)
    return fault_cluster


@pytest.fixture
def tally(request):
    """This test's counts; printed, and added to the session's totals printed at the end."""
    t = Tally()
    yield t
    print("\n" + t.line(request.node.name))
    TOTALS.add(t)


def pytest_terminal_summary(terminalreporter):
    if TOTALS.requests or TOTALS.malformed:
        terminalreporter.write_line(TOTALS.line("tests/faults totals"))
