"""A node's start-up transport self-test: a real loopback transfer per transport, its result exported."""

from __future__ import annotations

import time

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.self_test import run_self_test
from kvwire.observability.metrics import Metrics

# what a self-test on this host must report: the transports served, and what carried each one's bytes
EXPECTED = {ConnectorKind.UCX: {ConnectorKind.UCX}, ConnectorKind.AUTO: {ConnectorKind.SHM, ConnectorKind.UCX},
            ConnectorKind.TCP: {ConnectorKind.TCP}, ConnectorKind.SHM: {ConnectorKind.SHM},
            ConnectorKind.NCCL: {ConnectorKind.NCCL}}
SHARED_MEMORY_UCX = {"sysv", "posix", "cma", "xpmem", "knem", "self"}


def _config(kind: ConnectorKind, node_id: str, host: str = "127.0.0.1") -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=NodeRole.DECODE, node_id=node_id, redis_url="redis://unused", host=host)


def test_loopback_moves_real_bytes_over_each_transport_served(connector_kind):
    start = time.monotonic()
    checks = run_self_test(_config(connector_kind, f"st-{connector_kind}"), epoch=3)
    assert time.monotonic() - start < 5  # start-up cost (UCX's first import included)
    assert {c.transport for c in checks} == EXPECTED[connector_kind]
    for c in checks:
        assert c.ok, c.reason
        assert c.ms > 0
        if c.transport == ConnectorKind.UCX:  # same process, same host: UCX's shared memory and CMA
            assert set(c.path.split("/")) <= SHARED_MEMORY_UCX and c.path, c.path
        else:
            assert c.path == {"nccl": "gloo"}.get(c.transport, str(c.transport))


def test_a_failed_self_test_says_why():
    # 192.0.2.1 (TEST-NET-1) is no address of this host: the transfer server cannot bind its side channel
    [check] = run_self_test(_config(ConnectorKind.TCP, "st-fail", host="192.0.2.1"), epoch=1)
    assert not check.ok and check.transport == ConnectorKind.TCP and check.path == "unknown"
    assert check.reason.startswith(("OSError", "ZMQError")), check.reason  # the bind's own error


def test_metrics_name_the_transport_and_its_path():
    m = Metrics()
    m.report_transport_checks(run_self_test(_config(ConnectorKind.TCP, "st-metrics"), epoch=1))
    text = m.exposition().decode()
    assert 'kvwire_transport_info{path="tcp",self_test="ok",transport="tcp"} 1.0' in text
    assert 'kvwire_transport_self_test_seconds{transport="tcp"}' in text
