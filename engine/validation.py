"""The one check of a prompt that the router, the prefill node and the engine all apply."""

from __future__ import annotations


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
