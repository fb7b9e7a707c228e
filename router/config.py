"""The router process's configuration, built in `cli/`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvwire.router.body_limit import MAX_BODY_BYTES


class RoutingPolicy(enum.StrEnum):
    """How the router picks a decode instance or node (router/vllm/schedule.py, router/placement.py)."""

    PREFIX = "prefix"  # by the prompt blocks each instance holds (predicted), weighed against its load
    LOAD = "load"  # by load alone; the prompt is not read for it


@dataclass(frozen=True)
class RouterConfig:
    """Attributes:
    model_dir: checkpoint whose tokenizer, chat template and context length the router uses.
    redis_url: the directory.
    host, port: where the HTTP API listens.
    request_timeout_s: a request with no final answer by then gets a 504.
    served_model_names: the ids a request's `model` may name, all listed in /v1/models (answers name the
        first); empty: the checkpoint directory's name (a path to it is accepted too).
    lenient: request fields kvwire does not know are dropped with a warning, not refused with a 400.
    auth_secret: shared secret sealing control messages to and from nodes; None: no authentication.
    decode_only_below: prompts of which the decode node picked holds all but fewer than this many tokens go
        decode-only (it computes them, no prefill node; reason short-prompt, or cached-on-decode when it holds
        some); 0: every prompt disaggregated when a prefill node is live.
    prefill_max_in_flight: a request goes decode-only (reason prefill-saturated) when every live prefill node has
        this many of the router's requests in flight, each until its first token (0: no limit).
    routing: PREFIX places a prompt on the decode node whose prefix cache holds most of it, weighed against its
        free blocks (router/placement.py); LOAD by free blocks alone.
    prefix_ttl_s: how long a decode node is taken to hold what it was last sent or answered.
    max_body_bytes: a request body over this many bytes gets a 413 before it is read (router/body_limit.py).
    traces_endpoint: OTLP/HTTP endpoint for the router's spans (observability/tracing.py); "": none.
    """

    model_dir: Path
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 120.0
    served_model_names: tuple[str, ...] = ()
    lenient: bool = False
    auth_secret: bytes | None = field(default=None, repr=False)
    decode_only_below: int = 0
    prefill_max_in_flight: int = 0
    routing: RoutingPolicy = RoutingPolicy.PREFIX
    prefix_ttl_s: float = 120.0
    max_body_bytes: int = MAX_BODY_BYTES
    traces_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        if any(not name for name in self.served_model_names):
            raise ValueError("a served model name must not be empty")
        if min(self.decode_only_below, self.prefill_max_in_flight) < 0:
            raise ValueError("decode_only_below and prefill_max_in_flight must not be negative")
        if self.prefix_ttl_s <= 0:
            raise ValueError("prefix_ttl_s must be positive")

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else self.model_dir.name

    def serves(self, model: str) -> bool:
        """Whether a request's `model` names the served model."""
        if self.served_model_names:
            return model in self.served_model_names
        return model == self.model_dir.name or Path(model).resolve() == self.model_dir.resolve()


@dataclass(frozen=True)
class VLLMRouterConfig:
    """The router fronting vLLM servers (`kvwire router --vllm-decode ...`).

    Attributes:
        prefill_urls: base URLs (no /v1) of the vLLM instances that compute prompts; empty: decode alone.
        decode_urls: base URLs of the vLLM instances that generate; at least one.
        host, port: where the HTTP API listens.
        request_timeout_s: longest wait for an instance's next bytes (a whole answer unless streaming): then 504.
        connect_timeout_s: a call that has no connection by then is tried again (the instance counts as slow).
        health_interval_s: seconds between GET /health probes of every instance.
        instance_wait_s: how long after its arrival a request may wait for a decode instance to take it (none
            up, or none accepting connections) before it gets a 503 (or a 502 with the last one's error).
        max_failures: broken calls or 5xx answers in a row that take an instance out of rotation.
        unresponsive_s: an instance that answered nothing for this long (timeouts only) leaves rotation.
        prefill_max_in_flight: a request goes decode-only when every prefill instance up has this many requests of
            the router in flight (0: no limit).
        sequential: start a request's decode step only once its prefill instance has answered, even where its
            answers showed KvwireConnector (which lets the decode step start alongside: router/vllm/proxy.py).
        routing: how instances are picked (RoutingPolicy).
        decode_only_below: a request goes decode-only when the decode instance picked holds all but fewer than this
            many of its prompt's tokens (0: never for this reason).
        prefix_ttl_s: how long an instance is taken to hold a prompt's blocks after it was last sent them.
        decode_kv_events: the ZMQ endpoints of the decode instances' KV event publishers (vLLM's
            --kv-events-config), in `decode_urls`' order, "" for one without; empty: none (router/kv_events.py).
    Raises:
        ValueError: no decode URL, a URL that is not http(s)://host[:port][/prefix], or one named twice in a role
            (one instance may serve both roles: vLLM's kv_both).
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 2.0
    health_interval_s: float = 2.0
    instance_wait_s: float = 30.0
    max_failures: int = 3
    unresponsive_s: float = 30.0
    prefill_max_in_flight: int = 0
    sequential: bool = False
    routing: RoutingPolicy = RoutingPolicy.PREFIX
    decode_only_below: int = 512
    prefix_ttl_s: float = 120.0
    decode_kv_events: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    traces_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        if not self.decode_urls:
            raise ValueError("at least one vLLM decode instance is needed")
        for url in self.prefill_urls + self.decode_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
                raise ValueError(f"{url!r} is not a vLLM base URL like http://10.0.0.5:8000")
            if url.endswith("/") or parts.path.rstrip("/").endswith("/v1"):
                raise ValueError(f"{url!r}: give the base URL, without /v1 or a trailing slash")
        for urls in (self.prefill_urls, self.decode_urls):
            if len(set(urls)) != len(urls):
                raise ValueError(f"a vLLM instance is named twice in {', '.join(urls)}")
        if min(self.request_timeout_s, self.connect_timeout_s, self.health_interval_s, self.unresponsive_s) <= 0:
            raise ValueError("timeouts and the health interval must be positive")
        if min(self.instance_wait_s, self.prefill_max_in_flight, self.decode_only_below) < 0 or self.max_failures < 1:
            raise ValueError("the instance wait, prefill_max_in_flight and decode_only_below must not be negative, "
                             "and max_failures must be 1 or more")
        if self.prefix_ttl_s <= 0:
            raise ValueError("the prefix TTL must be positive")
        if self.decode_kv_events and len(self.decode_kv_events) != len(self.decode_urls):
            raise ValueError(f"{len(self.decode_kv_events)} KV event endpoints for {len(self.decode_urls)} decode "
                             "instances: give one per decode instance, in their order (empty for one without)")
        for endpoint in self.decode_kv_events:
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{endpoint!r} is not a ZMQ endpoint like tcp://10.0.0.5:5557")
