"""The one check of a prompt and of sampling parameters that the router, the nodes and the engine all apply.

No torch: the router imports it.
"""

from __future__ import annotations

import math

from kvwire.protocol.work import SamplingParams

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]


def prompt_problem(prompt_ids: list[int], vocab_size: int, max_model_len: int, max_tokens: int = 0) -> str | None:
    """Why this prompt (plus max_tokens of output) cannot be served, or None if it can."""
    if not prompt_ids:
        return "prompt must not be empty"
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        return f"token ids must be in [0, {vocab_size})"
    if len(prompt_ids) + max_tokens > max_model_len:
        return (f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"length {max_model_len}")
    return None


class ParamError(ValueError):
    """A `SamplingParams` field out of its range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_params(params: SamplingParams) -> None:
    """The one check of sampling parameters (the router's 400s and the nodes' refusals both come from it).

    Raises:
        ParamError: the first field out of its range (NaN is out of every range).
    """
    p, pen = params, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]"
    rules = [
        ("temperature", p.temperature >= 0 and math.isfinite(p.temperature), ">= 0"),
        ("top_p", 0 < p.top_p <= 1, "in (0, 1]"),
        ("top_k", p.top_k >= -1, ">= -1 (0 or -1: all tokens)"),
        ("min_p", 0 <= p.min_p <= 1, "in [0, 1]"),
        ("repetition_penalty", p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty), "> 0"),
        ("presence_penalty", -MAX_PENALTY <= p.presence_penalty <= MAX_PENALTY, pen),
        ("frequency_penalty", -MAX_PENALTY <= p.frequency_penalty <= MAX_PENALTY, pen),
        ("min_tokens", 0 <= p.min_tokens <= p.max_tokens, "in [0, max_tokens]"),
        ("logprobs", p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]"),
        ("stop_token_ids", all(t >= 0 for t in p.stop_token_ids), "non-negative"),
    ]
    for name, ok, rule in rules:
        if not ok:
            raise ParamError(name, f"{name} must be {rule}, got {getattr(p, name)!r}")
