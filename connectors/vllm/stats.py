"""What the connector tells vLLM's `/metrics` and stats log: pulls made, and prompts recomputed by reason.

1. The worker half counts as it goes (tally.py: pulls, their bytes and seconds; failed pulls by
   `TransferFailure`), the scheduler half counts prompts it declines to pull (`mismatch`).
2. Each step vLLM asks both (`get_kv_connector_stats`): the counts since the last ask, as a
   `KvwireStats` whose `data` is plain numbers (it crosses from worker processes to the engine).
3. vLLM sums the ranks' and the scheduler's (`aggregate`), logs `reduce()` with its stats, and hands the
   sums to `KvwirePromMetrics.observe`, which adds them to these series on vLLM's `/metrics`:
   `vllm:kvwire_kv_pulls_total`, `vllm:kvwire_kv_pull_bytes_total`, `vllm:kvwire_kv_pull_seconds`
   `vllm:kvwire_kv_transfers_failed_total{reason}`: every prompt meant to receive KV that was
   recomputed instead; `vllm:kvwire_kv_transport_fallbacks_total{reason}`: pulls that took a slower
   transport than they would have (the KV still came); `vllm:kvwire_kv_pulls_by_path_total{path}`: what
   carried each pull's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvwire.connectors.vllm.tally import empty
from kvwire.observability.labels import RejectReason, TransferFailure, TransportFallback

PULL_SECONDS_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]


@dataclass
class KvwireStats(KVConnectorStats):
    """Counts since the last report, summed over the ranks and the scheduler."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # counts from a rank that sends fewer kinds (an older kvwire): the missing ones are 0
            for kind, none in empty().items():
                self.data.setdefault(kind, none)

    def reset(self) -> None:
        self.data = empty()

    def is_empty(self) -> bool:
        return self.data["pulls"] == 0 and not self.data["failed"] and not self.data.get("rejected")

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        self.data["pulls"] += other.data["pulls"]
        self.data["pull_bytes"] += other.data["pull_bytes"]
        self.data["rejected"] += other.data.get("rejected", 0)
        self.data["pull_seconds"].extend(other.data["pull_seconds"])
        for key in ("failed", "fallbacks", "paths"):
            for reason, n in other.data.get(key, {}).items():
                self.data[key][reason] = self.data[key].get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["pull_seconds"]
        out: dict[str, int | float] = {
            "KV pulls": self.data["pulls"], "MB pulled": round(self.data["pull_bytes"] / 2**20, 3),
            "Avg pull (ms)": round(sum(seconds) / len(seconds) * 1e3, 3) if seconds else 0}
        out.update({f"Recomputed ({reason})": n for reason, n in sorted(self.data["failed"].items())})
        out.update({f"Slower transport ({reason})": n for reason, n in sorted(self.data["fallbacks"].items())})
        if self.data["rejected"]:
            out["Unsealed messages refused"] = self.data["rejected"]
        return out


class KvwirePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._pulls = create_metric_per_engine(self._counter_cls(
            name="vllm:kvwire_kv_pulls", documentation="Prompts whose KV kvwire pulled from a prefill server.",
            labelnames=labelnames), per_engine_labelvalues)
        self._bytes = create_metric_per_engine(self._counter_cls(
            name="vllm:kvwire_kv_pull_bytes", documentation="Bytes of KV kvwire pulled.", labelnames=labelnames),
            per_engine_labelvalues)
        self._seconds = create_metric_per_engine(self._histogram_cls(
            name="vllm:kvwire_kv_pull_seconds", documentation="Time of one prompt's KV pull, from its location "
            "known to its blocks written.", buckets=PULL_SECONDS_BUCKETS, labelnames=labelnames),
            per_engine_labelvalues)
        self._failed = self._counter_cls(
            name="vllm:kvwire_kv_transfers_failed", documentation="Prompts meant to receive their KV that were "
            "recomputed instead, by reason.", labelnames=[*labelnames, "reason"])
        self._fallbacks = self._counter_cls(
            name="vllm:kvwire_kv_transport_fallbacks", documentation="Pulls that moved their KV over a slower "
            "transport than they would have taken (e.g. UCX where the kernel refused cross-memory attach), by reason.",
            labelnames=[*labelnames, "reason"])
        self._paths = self._counter_cls(
            name="vllm:kvwire_kv_pulls_by_path", documentation="Pulls by what carried their bytes: cma (this host's "
            "memory, read from the prefill process), cuda_ipc, shm, UCX's transports (e.g. sysv/posix), tcp, nccl.",
            labelnames=[*labelnames, "path"])
        self._rejected = self._counter_cls(
            name="vllm:kvwire_messages_rejected", documentation="Control messages kvwire refused: no valid seal "
            "(auth_secret_file), e.g. a pull request forged from outside or from a server with another secret.",
            labelnames=[*labelnames, "reason"])
        for values in per_engine_labelvalues.values():  # every reason shows, at 0, from the start
            self._rejected.labels(*values, str(RejectReason.UNAUTHENTICATED))
            for reason in TransferFailure:
                self._failed.labels(*values, str(reason))
            for fallback in TransportFallback:
                self._fallbacks.labels(*values, str(fallback))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._pulls[engine_idx].inc(transfer_stats_data["pulls"])
        self._bytes[engine_idx].inc(transfer_stats_data["pull_bytes"])
        for seconds in transfer_stats_data["pull_seconds"]:
            self._seconds[engine_idx].observe(seconds)
        values = self.per_engine_labelvalues[engine_idx]
        for reason, n in transfer_stats_data["failed"].items():
            self._failed.labels(*values, reason).inc(n)
        for reason, n in transfer_stats_data.get("fallbacks", {}).items():
            self._fallbacks.labels(*values, reason).inc(n)
        for path, n in transfer_stats_data.get("paths", {}).items():
            self._paths.labels(*values, path).inc(n)
        self._rejected.labels(*values, str(RejectReason.UNAUTHENTICATED)).inc(transfer_stats_data.get("rejected", 0))
