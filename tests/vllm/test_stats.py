"""KvwireConnector's stats as vLLM handles them: summed over ranks, logged, and put on /metrics; and the
worker's warning once per peer and reason. In-process, no server (the servers' /metrics: test_pd_*.py)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvwire.connectors.base import TransferError
from kvwire.connectors.consumer.errors import ReceiveError
from kvwire.connectors.vllm.connector import KvwireConnector
from kvwire.connectors.vllm.identity import EngineShape
from kvwire.connectors.vllm.settings import VLLMSettings
from kvwire.connectors.vllm.stats import KvwirePromMetrics, KvwireStats
from kvwire.connectors.vllm.worker import WorkerHalf
from kvwire.observability.labels import TransferFailure


def test_ranks_stats_sum_and_reduce_for_vllms_log():
    a = KvwireConnector.build_kv_connector_stats({"pulls": 2, "pull_bytes": 3 << 20, "pull_seconds": [0.001, 0.003],
                                                  "failed": {"deadline": 1}})
    b = KvwireStats(data={"pulls": 1, "pull_bytes": 0, "pull_seconds": [0.002], "failed": {"deadline": 1,
                                                                                        "transport": 2},
                          "fallbacks": {"cma_refused": 1}, "paths": {"sysv/posix": 1}})
    assert not a.is_empty() and KvwireStats().is_empty()
    total = a.aggregate(b).aggregate(KvwireStats())  # `a` has no fallbacks or paths (an older rank): 0 of each
    assert total.data["failed"] == {"deadline": 2, "transport": 2} and total.data["paths"] == {"sysv/posix": 1}
    assert total.reduce() == {"KV pulls": 3, "MB pulled": 3.0, "Avg pull (ms)": 2.0, "Recomputed (deadline)": 2,
                              "Recomputed (transport)": 2, "Slower transport (cma_refused)": 1}


def test_prometheus_series_count_pulls_and_every_reason(monkeypatch):
    registry = CollectorRegistry()
    types = {cls: (lambda c: lambda *a, **k: c(*a, registry=registry, **k))(cls) for cls in (Counter, Gauge, Histogram)}
    prom = KvwirePromMetrics(_Config(), types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"pulls": 3, "pull_bytes": 4096, "pull_seconds": [0.01, 0.02, 0.03], "failed": {"producer": 2},
                  "fallbacks": {"cma_refused": 1}, "paths": {"cma": 2, "sysv/posix": 1}}, 0)
    value = registry.get_sample_value
    assert value("vllm:kvwire_kv_pulls_total", {"model_name": "tiny", "engine": "0"}) == 3
    assert value("vllm:kvwire_kv_pull_bytes_total", {"model_name": "tiny", "engine": "0"}) == 4096
    assert value("vllm:kvwire_kv_pull_seconds_count", {"model_name": "tiny", "engine": "0"}) == 3
    failed = {r: value("vllm:kvwire_kv_transfers_failed_total", {"model_name": "tiny", "engine": "0", "reason": r})
              for r in TransferFailure}
    assert failed == {**{r: 0 for r in TransferFailure}, "producer": 2}, "every reason shows, from 0"
    labels = {"model_name": "tiny", "engine": "0"}
    assert value("vllm:kvwire_kv_transport_fallbacks_total", {**labels, "reason": "cma_refused"}) == 1
    assert value("vllm:kvwire_kv_pulls_by_path_total", {**labels, "path": "cma"}) == 2
    assert value("vllm:kvwire_kv_pulls_by_path_total", {**labels, "path": "sysv/posix"}) == 1


class _Config:
    kv_transfer_config = None


def test_failed_pulls_are_counted_and_each_peer_and_reason_warned_about_once(caplog):
    settings = VLLMSettings.parse("kv_consumer", {"redis_url": "redis://127.0.0.1:1/0"}, EngineShape("e"))
    worker = WorkerHalf(settings, num_blocks=8, block_size=16)
    try:
        with caplog.at_level(logging.INFO, logger="kvwire.connectors.vllm.worker"):
            for rid, peer in (("a", "p0"), ("b", "p0"), ("c", "p1")):
                worker._failed_pull(rid, ReceiveError(rid, peer, "KV not READY before the deadline",
                                                      TransferFailure.DEADLINE))
            worker._failed_pull("d", TransferError("d", "p0", "connection reset"))
    finally:
        worker.close()
    levels = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [(logging.WARNING, "request a"), (logging.INFO, "request b"), (logging.WARNING, "request c"),
                      (logging.WARNING, "request d")]
    assert "kv_deadline_s" in caplog.records[0].getMessage() and "advertise_host" in caplog.records[3].getMessage()
    assert worker.tally.take()["failed"] == {"deadline": 3, "transport": 1}


def test_a_pull_asked_of_a_server_that_does_not_consume_is_counted_and_recomputed():
    from kvwire.connectors.vllm.metadata import Pull
    from kvwire.connectors.vllm.params import RemotePrefill

    settings = VLLMSettings.parse("kv_producer", {"redis_url": "redis://127.0.0.1:1/0"}, EngineShape("e"))
    worker = WorkerHalf(settings, num_blocks=8, block_size=16)
    try:
        worker._expect("r", Pull(RemotePrefill("p-r", "p", 20, [[1, 2]]), 20, [3, 4], [0, 1]))
        assert worker.transfer_results() == (set(), {"r"}, {"r"})  # failed_recving: vLLM recomputes the prompt
        assert worker.tally.take()["failed"] == {"mismatch": 1}
    finally:
        worker.close()
