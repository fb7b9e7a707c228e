"""Metrics definitions, and the events the directory and the receiver record into them."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import SequenceInput
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.transport import Transport
from kvwire.observability.labels import DirectoryOp, Queue, RecomputeReason, RequestStatus, TransferFailure
from kvwire.observability.metrics import Metrics, process_metrics
from tests.connectors.directory.test_directory import location


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} parsed back from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_transfer_and_gauges_are_exported_under_their_names():
    m = Metrics()
    m.observe_transfer("tcp", 1000, 0.002)
    m.observe_transfer("tcp", 24, 0.001)
    free = [7]
    m.watch_blocks(lambda: free[0], 10)
    m.watch_queue(Queue.DECODE_RUNNING, lambda: 3)
    free[0] = 4  # gauges read at scrape time
    got = samples(m)
    assert got[("kvwire_kv_transfer_bytes_total", frozenset({("connector", "tcp")}))] == 1024
    assert got[("kvwire_kv_transfer_seconds_count", frozenset({("connector", "tcp")}))] == 2
    assert got[("kvwire_kv_blocks", frozenset({("state", "free")}))] == 4
    assert got[("kvwire_kv_blocks", frozenset({("state", "used")}))] == 6
    assert got[("kvwire_queue_depth", frozenset({("queue", "decode_running")}))] == 3


@pytest.mark.parametrize("name, label, values", [
    ("kvwire_kv_transfers_failed_total", "reason", TransferFailure),
    ("kvwire_recomputes_total", "reason", RecomputeReason),
    ("kvwire_requests_total", "status", RequestStatus),
])
def test_enum_labelled_counters_start_at_zero(name, label, values):
    got = samples(Metrics())
    assert {got[(name, frozenset({(label, str(v))}))] for v in values} == {0.0}


def test_each_metrics_object_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.requests.labels("ok").inc()
    assert samples(b)[("kvwire_requests_total", frozenset({("status", "ok")}))] == 0
    assert process_metrics() is process_metrics()


def test_directory_times_its_operations(redis_url):
    m = Metrics()
    directory = KVDirectory(redis_url, metrics=m)
    try:
        directory.create_pending("r1", "prefill-0")
        directory.transition("r1", {TransferState.PENDING}, TransferState.FAILED, "x")
        directory.wait_for("r1", {TransferState.READY}, time.monotonic())
    finally:
        directory.close()
    got = samples(m)
    for op in (DirectoryOp.CREATE_PENDING, DirectoryOp.TRANSITION, DirectoryOp.WAIT_FOR):
        assert got[("kvwire_directory_op_seconds_count", frozenset({("op", str(op))}))] == 1


class _NoPuller:
    transport_address = b""

    def pull(self, *args) -> int:
        raise AssertionError("nothing should be pulled")

    def flush(self, older_than_s: float = 0.0) -> None:
        pass

    def close(self) -> None:
        pass


class _NoPullTransport(Transport):
    kind = ConnectorKind.TCP

    def send_engines(self, region):
        raise AssertionError("a consumer builds no send engines")

    def puller(self, region) -> _NoPuller:
        return _NoPuller()


def _receiver(redis_url: str, m: Metrics) -> tuple[KVConsumer, KVDirectory]:
    config = ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.DECODE, node_id="decode-0", redis_url=redis_url)
    directory = KVDirectory(redis_url, metrics=m)
    layout = location("x").layout
    region = KVRegion.from_kv_caches(KVPool.allocate(layout, 8).kv_caches)
    return KVConsumer(config, directory, _NoPullTransport(config, 1), region, metrics=m), directory


def _failed(m: Metrics, reason: TransferFailure) -> float:
    return samples(m)[("kvwire_kv_transfers_failed_total", frozenset({("reason", str(reason))}))]


def test_receiver_counts_failures_by_reason(redis_url):
    m = Metrics()
    receiver, directory = _receiver(redis_url, m)
    try:
        with pytest.raises(TransferError):  # nothing published: the deadline passes
            receiver.receive(SequenceInput("late", list(range(40)), 0, [1, 2, 3]),
                             ExpectedKV("late", "", time.monotonic() + 0.05))
        directory.publish_ready(location("short"))  # the producer has 40 tokens, we ask for 39
        with pytest.raises(TransferError):
            receiver.receive(SequenceInput("short", list(range(39)), 0, [1, 2, 3]),
                             ExpectedKV("short", "", time.monotonic() + 1))
    finally:
        receiver.close()
        directory.close()
    assert _failed(m, TransferFailure.DEADLINE) == 1
    assert _failed(m, TransferFailure.MISMATCH) == 1
    assert _failed(m, TransferFailure.TRANSPORT) == 0


def test_the_standard_process_and_gc_collectors_are_exported():
    from kvwire.observability.metrics import Metrics

    text = Metrics().exposition().decode()
    for series in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_gc_objects_collected_total",
                   "python_info"):
        assert f"\n{series}" in text or text.startswith(series), series
