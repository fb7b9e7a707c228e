"""What a decode instance's answer says it held of the prompt, against what the router predicted.

A request sent decode-only because its decode instance was predicted to hold most of its prompt
(PathReason.CACHED_ON_DECODE) is computed there again, whole or in part, when the prediction was wrong: the
blocks were evicted, or held in another cache scope (router/vllm/cache_scope.py). vLLM says how many prompt tokens
it read from its cache in the answer's usage (with --enable-prompt-tokens-details): `prompt_tokens_details` of a
completion or chat, `input_tokens_details` of a Response, `cache_read_input_tokens` of a Message. Fewer than
predicted is a miss, counted (kvwire_vllm_prefix_misses_total, and the tokens in
kvwire_vllm_prefix_missed_tokens_total) where users look for the recomputes nobody asked for.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvwire.observability.metrics import Metrics

log = logging.getLogger(__name__)
_MARKS = (b'"cached_tokens"', b'"cache_read_input_tokens"')  # a stream's chunk that may carry them


def cached_tokens_of(answer: Any) -> int | None:
    """The prompt tokens a JSON answer (or a stream's event) says were read from the cache; None: it does not say."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return cached_tokens_of(answer.get("response")) if isinstance(answer.get("response"), dict) else None
    for details in ("prompt_tokens_details", "input_tokens_details"):
        if isinstance(usage.get(details), dict) and isinstance(n := usage[details].get("cached_tokens"), int):
            return n
    n = usage.get("cache_read_input_tokens")
    return n if isinstance(n, int) else None


def cached_tokens_in(body: bytes, stream: bool) -> int | None:
    """`cached_tokens_of` a whole answer's bytes, or of a stream chunk's last event that says (None: none does)."""
    if not stream:
        try:
            return cached_tokens_of(json.loads(body))
        except ValueError:
            return None
    if not any(mark in body for mark in _MARKS):
        return None
    found = None
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if (n := cached_tokens_of(event)) is not None:
                found = n
    return found


def check_held(metrics: Metrics, rid: str, url: str, held: int, cached: int | None) -> None:
    """Count a miss when decode instance `url`, predicted to hold `held` of request `rid`'s prompt tokens, said it
    read `cached` of them from its cache (None: it did not say, nothing counted)."""
    if cached is None or cached >= held:
        return
    metrics.vllm_prefix_misses.inc()
    metrics.vllm_prefix_missed_tokens.inc(held - cached)
    log.info("request %s: decode instance %s was predicted to hold %d prompt tokens and read %d from its cache: the "
             "rest computed again (kvwire_vllm_prefix_misses_total)", rid, url, held, cached)
