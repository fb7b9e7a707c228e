"""What a vLLM instance's own GET /metrics says of its load and its KV cache, read at each health check."""

from __future__ import annotations

import re
from typing import NamedTuple

import httpx2

from kvwire.router.vllm.upstream import PEER_ERRORS

_SAMPLE = re.compile(r'^(vllm:[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class ServerLoad(NamedTuple):
    """An instance's queue and KV cache, summed over its engines (data parallel).

    Attributes:
        waiting: requests queued, not yet scheduled (vllm:num_requests_waiting).
        kv_usage: the share of its KV blocks in use, 0 to 1 (vllm:kv_cache_usage_perc; its fullest engine's).
            vLLM sets it at each engine step, so an idle server shows its last busy step's: a figure for
            whether the cache is nearly full, not a count of other clients' blocks.
        block_size: tokens per KV block (vllm:cache_config_info); 0 when the metric was missing.
        cache_dtype: its KV cache's --kv-cache-dtype (vllm:cache_config_info); "" when the metric was missing.
        engines: each data-parallel engine's requests, waiting and running, by its index (the `engine` label,
            vLLM's data-parallel rank); () for a server of one engine.
    """

    waiting: int
    kv_usage: float
    block_size: int
    engines: tuple[int, ...] = ()
    cache_dtype: str = ""


def parse_server_metrics(text: str) -> ServerLoad:
    """Returns: the load that vLLM's Prometheus exposition `text` shows (0s where a series is missing)."""
    waiting, usage, block_size, cache_dtype = 0.0, [0.0], 0, ""
    engines: dict[int, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))
        if value != value:  # NaN
            continue
        if name in ("vllm:num_requests_waiting", "vllm:num_requests_running") and labels.get("engine", "").isdigit():
            engine = int(labels["engine"])
            engines[engine] = engines.get(engine, 0.0) + value
        if name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:kv_cache_usage_perc":
            usage.append(value)
        elif name == "vllm:cache_config_info":
            block_size = int(labels.get("block_size") or 0) or block_size
            cache_dtype = labels.get("cache_dtype") or cache_dtype
    ranks = tuple(int(engines.get(i, 0)) for i in range(max(engines) + 1)) if len(engines) > 1 else ()
    return ServerLoad(int(waiting), max(usage), block_size, ranks, cache_dtype)


async def scrape(client: httpx2.AsyncClient, url: str, timeout: httpx2.Timeout) -> ServerLoad | None:
    """GET {url}/metrics. Returns: what it shows; None when it did not answer 200 in time."""
    try:
        resp = await client.get(f"{url}/metrics", timeout=timeout)
    except PEER_ERRORS:
        return None
    return parse_server_metrics(resp.text) if resp.status_code == 200 else None
