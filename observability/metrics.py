"""Every Prometheus metric kvwire exports, in one registry per `Metrics` object.

A process uses one `Metrics`, `process_metrics()`, which the node's or router's
/metrics endpoint serves; it is not prometheus_client's global default registry, so
components under test can be handed a fresh `Metrics()` of their own and read it alone.
Label values come from the enums of observability/labels.py, so every series is a
closed set; the enum-labelled counters start at 0 for every value. The standard collectors ride along
(`process_*`, `python_gc_*`, `python_info`), as on prometheus_client's default registry.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvwire.observability.labels import (
    NODES_PATH_REASONS,
    VLLM_PATH_REASONS,
    BlockState,
    InstanceState,
    KVEventKind,
    ProxyPath,
    Queue,
    RecomputeReason,
    RejectReason,
    RequestStatus,
    SelfTestOutcome,
    TransferFailure,
    TransportFallback,
    path_of,
)


class TransportCheck(Protocol):
    """What a node's start-up self-test says of one transport (connectors.wire.TransportCheck)."""

    @property
    def transport(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def ok(self) -> bool: ...
    @property
    def ms(self) -> float: ...


CONTENT_TYPE = CONTENT_TYPE_LATEST
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """kvwire's metrics over one CollectorRegistry (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        for standard in (ProcessCollector, GCCollector, PlatformCollector):  # process_*, python_gc_*, python_info
            standard(registry=r)
        self.kv_transfer_bytes = Counter("kvwire_kv_transfer_bytes",
                                         "KV and hidden-state bytes received, per connector",
                                         ["connector"], registry=r)
        self.kv_transfer_seconds = Histogram("kvwire_kv_transfer_seconds",
                                             "Time to pull one request's KV, per connector",
                                             ["connector"], buckets=_FAST_BUCKETS, registry=r)
        self.kv_transfers_failed = Counter("kvwire_kv_transfers_failed", "KV pulls that failed, by reason",
                                           ["reason"], registry=r)
        self.transport_fallbacks = Counter("kvwire_transport_fallbacks", "KV pulls moved over a slower transport "
                                           "than the one they would have taken, by reason", ["reason"], registry=r)
        self.recomputes = Counter("kvwire_recomputes", "Prompts a decode node computed itself, by reason",
                                  ["reason"], registry=r)
        self.prompt_tokens_cached = Counter("kvwire_prompt_tokens_cached", "Prompt tokens a node found in its prefix "
                                            "cache (neither computed nor received)", registry=r)
        self.directory_op_seconds = Histogram("kvwire_directory_op_seconds", "Latency of directory (Redis) operations",
                                              ["op"], buckets=_FAST_BUCKETS, registry=r)
        self.kv_blocks = Gauge("kvwire_kv_blocks", "KV blocks of this node's pool, used or free", ["state"], registry=r)
        self.queue_depth = Gauge("kvwire_queue_depth", "Requests in each of this node's queues", ["queue"], registry=r)
        self.ttft_seconds = Histogram("kvwire_ttft_seconds", "Time to first token (arrival here to first token)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_forward_seconds = Histogram("kvwire_prompt_forward_seconds",
                                                "Model forward of one prompt batch computed on this node",
                                                buckets=_FAST_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("kvwire_time_per_output_token_seconds",
                                      "Mean time per output token after the first, per request",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.requests = Counter("kvwire_requests", "Completion requests answered by the router, by status",
                                ["status"], registry=r)
        self.messages_rejected = Counter("kvwire_messages_rejected", "Control messages from other processes dropped, "
                                         "by reason", ["reason"], registry=r)
        self.path_reasons = Counter("kvwire_path_reasons", "Choices the router sent to kvwire's nodes, by the path it "
                                    "took and why", ["path", "reason"], registry=r)
        self.vllm_requests = Counter("kvwire_vllm_requests", "Requests the router sent on to vLLM instances, by path",
                                     ["path"], registry=r)
        self.vllm_path_reasons = Counter("kvwire_vllm_path_reasons", "Requests the router sent on to vLLM instances, "
                                         "by the path it took and why", ["path", "reason"], registry=r)
        self.vllm_instance_failures = Counter("kvwire_vllm_instance_failures", "Calls from the router to vLLM "
                                              "instances that failed, by role and how", ["role", "kind"], registry=r)
        self.vllm_tokenize_failures = Counter("kvwire_vllm_tokenize_failures", "Prompts a vLLM instance's POST "
                                              "/tokenize did not give the router (placed by load alone)", registry=r)
        self.vllm_prefix_misses = Counter("kvwire_vllm_prefix_misses", "Requests the router sent decode-only as held "
                                          "on their decode instance (cached-on-decode) whose answer said it read "
                                          "fewer prompt tokens from its cache", registry=r)
        self.vllm_prefix_missed_tokens = Counter("kvwire_vllm_prefix_missed_tokens", "Prompt tokens the router "
                                                 "predicted held on the decode instance it sent a request to "
                                                 "decode-only, which that instance computed again", registry=r)
        self.vllm_kv_events = Counter("kvwire_vllm_kv_events", "KV cache events the router read from vLLM decode "
                                      "instances (--vllm-kv-events), by kind", ["kind"], registry=r)
        # `path` is what UCX reported (e.g. "sysv/cma"), not a closed set: one series per transport served
        self.transport_info = Gauge("kvwire_transport_info", "The start-up transport self-test: 1 for each transport "
                                    "served, with the path that carried its bytes and whether it passed",
                                    ["transport", "path", "self_test"], registry=r)
        self.transport_self_test_seconds = Gauge("kvwire_transport_self_test_seconds",
                                                 "Time of the start-up loopback transfer, per transport",
                                                 ["transport"], registry=r)
        self.vllm_instances = Gauge("kvwire_vllm_instances", "vLLM instances the router fronts, by role and state",
                                    ["role", "state"], registry=r)
        for counter, labels in ((self.kv_transfers_failed, TransferFailure), (self.recomputes, RecomputeReason),
                                (self.requests, RequestStatus), (self.messages_rejected, RejectReason),
                                (self.vllm_requests, ProxyPath), (self.vllm_kv_events, KVEventKind),
                                (self.transport_fallbacks, TransportFallback)):
            for value in labels:
                counter.labels(str(value))
        for counter, reasons in ((self.vllm_path_reasons, VLLM_PATH_REASONS), (self.path_reasons, NODES_PATH_REASONS)):
            for reason in reasons:
                counter.labels(str(path_of(reason)), str(reason))

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (serve with CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def observe_transfer(self, connector: str, nbytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.labels(connector).inc(nbytes)
        self.kv_transfer_seconds.labels(connector).observe(seconds)

    def report_transport_checks(self, checks: Sequence[TransportCheck]) -> None:
        """Export a node's start-up transport self-test (connectors/self_test.py)."""
        for c in checks:
            outcome = SelfTestOutcome.OK if c.ok else SelfTestOutcome.FAILED
            self.transport_info.labels(str(c.transport), c.path, str(outcome)).set(1)
            self.transport_self_test_seconds.labels(str(c.transport)).set(c.ms / 1e3)

    def watch_blocks(self, num_free: Callable[[], int], num_total: int) -> None:
        """Report the pool's used and free blocks, read from `num_free` at each scrape."""
        self.kv_blocks.labels(str(BlockState.FREE)).set_function(num_free)
        self.kv_blocks.labels(str(BlockState.USED)).set_function(lambda: num_total - num_free())

    def watch_queue(self, queue: Queue, depth: Callable[[], int]) -> None:
        """Report `queue`'s depth, read from `depth` at each scrape."""
        self.queue_depth.labels(str(queue)).set_function(depth)

    def watch_instances(self, role: str, count: Callable[[InstanceState], int]) -> None:
        """Report how many of `role`'s vLLM instances are up and down, read from `count` at each scrape."""
        for state in InstanceState:
            self.vllm_instances.labels(role, str(state)).set_function(functools.partial(count, state))


_process_metrics: Metrics | None = None
_lock = threading.Lock()


def process_metrics() -> Metrics:
    """This process's `Metrics`, created on first use."""
    global _process_metrics
    with _lock:
        if _process_metrics is None:
            _process_metrics = Metrics()
        return _process_metrics
