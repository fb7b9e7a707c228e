"""Next-token sampling: greedy, or temperature + top-p (nucleus) with a per-request generator.

A seeded request draws from its own `torch.Generator`, so its tokens depend only on its
logits and its seed, never on what else was sampled in the process.
"""

from __future__ import annotations

import torch

from kvwire.connectors.wire import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with seed, or from OS entropy when seed is None.

    Args:
        seed: the request's seed.
    Returns:
        The generator.
    """
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def check_params(params: SamplingParams) -> None:
    """Raises ValueError for a negative temperature or a top_p outside (0, 1]."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p.

    Args:
        probs: `[V]` probabilities.
        top_p: nucleus mass in (0, 1].
    Returns:
        `[V]` probabilities with the rest zeroed and renormalised.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)  # [V]
    mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs  # mass of strictly better tokens
    sorted_probs[mass_before >= top_p] = 0.0  # the most likely token always survives
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token.

    Args:
        logits: `[V]` float32 for one sequence.
        params: temperature 0 means greedy (argmax, ties to the lowest id).
        generator: the request's generator (from `make_generator`); None uses torch's global RNG.
    Returns:
        The token id.
    Raises:
        ValueError: invalid params or logits that are not one row.
    """
    check_params(params)
    if logits.dim() != 1:
        raise ValueError(f"expected logits [V], got {tuple(logits.shape)}")
    logits = logits.float().cpu()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)  # [V]
    probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
