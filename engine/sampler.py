"""Next-token sampling, in vLLM's order: the repetition, frequency and presence penalties, min_tokens' ban on
stop tokens, then greedy, or temperature, top-k, top-p (nucleus) and min-p with a per-request generator.
When asked, the sampled token's logprob and the most likely tokens' come from the raw logits.

A seeded request draws from its own `torch.Generator`, so its tokens depend only on its
logits and its seed, never on what else was sampled in the process. With every other field at
its default, a request takes exactly the steps (and the generator draws) it took before they existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvwire.engine.validation import check_params
from kvwire.protocol.work import SamplingParams, TokenLogprobs


class Sampled(NamedTuple):
    token: int
    logprobs: TokenLogprobs | None  # set when `SamplingParams.logprobs` is


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


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


@dataclass
class TokenHistory:
    """What the penalties and min_tokens need of one sequence's tokens; `record` keeps it up to date.

    The `[V]` tensors exist only when a penalty is set, so a request without one pays nothing.

    Attributes:
        num_output: tokens sampled so far.
        stop_ids: what min_tokens bans: EOS (even with ignore_eos, as vLLM) and stop_token_ids.
        in_prompt: `[V]` bool, the prompt's tokens; only with a repetition penalty.
        output_counts: `[V]` float32, how often each token was sampled; only with a penalty.
    """

    num_output: int = 0
    stop_ids: list[int] = field(default_factory=list)
    in_prompt: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None

    @classmethod
    def start(cls, prompt_ids: list[int], params: SamplingParams, vocab_size: int,
              eos_token_id: int | None = None) -> TokenHistory:
        """The history of a sequence about to sample its first token.

        Args:
            prompt_ids: the prompt (ids in [0, vocab_size)).
            params: the request's params: which tensors to keep.
            vocab_size: V, the logits' length.
            eos_token_id: the model's EOS, banned with stop_token_ids until min_tokens.
        """
        eos = [eos_token_id] if eos_token_id is not None else []
        in_prompt = None
        if params.repetition_penalty != 1.0:
            in_prompt = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
            in_prompt[torch.tensor(prompt_ids, dtype=torch.long)] = True
        counts = torch.zeros(vocab_size, dtype=torch.float32) if has_penalty(params) else None  # [V]
        return cls(0, eos + list(params.stop_token_ids), in_prompt, counts)

    def record(self, token: int) -> None:
        """Count one sampled token."""
        self.num_output += 1
        if self.output_counts is not None:
            self.output_counts[token] += 1


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """vLLM's penalties: repetition (prompt or output tokens: logit / p if positive, else logit * p), then
    frequency (logit -= f * count in output) and presence (logit -= p * (count in output > 0)).

    Args:
        logits: `[V]` float32; not changed.
        history: started with params (its tensors exist when a penalty is set).
    Returns:
        `[V]` float32, the penalised logits (logits itself when no penalty is set).
    Raises:
        ValueError: a penalty is set but history does not count tokens.
    """
    if not has_penalty(params):
        return logits
    counts = history.output_counts  # [V]
    if counts is None or (params.repetition_penalty != 1.0 and history.in_prompt is None):
        raise ValueError("penalties need a TokenHistory started with the same params")
    out = logits
    if params.repetition_penalty != 1.0:
        assert history.in_prompt is not None
        seen = history.in_prompt | (counts > 0)  # [V]
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        out = torch.where(seen, penalised, logits)
    if params.frequency_penalty != 0.0:
        out = out - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out = out - params.presence_penalty * (counts > 0).float()
    return out


def ban_stop_tokens(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """min_tokens: before that many tokens are out, EOS and stop_token_ids cannot be sampled.

    Args:
        logits: `[V]` float32; not changed.
    Returns:
        `[V]` float32 with the banned ids at -inf (logits itself when nothing is banned).
    """
    if history.num_output >= params.min_tokens or not history.stop_ids:
        return logits
    out = logits.clone()
    out[history.stop_ids] = -math.inf
    return out


def top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest values, largest first, ties to the lower id (no vocab-wide sort).

    Args:
        values: `[V]`.
        k: in [1, V].
    Returns:
        `[k]` int64 ids.
    """
    kth = torch.topk(values, k).values[-1]
    candidates = torch.nonzero(values >= kth).flatten()  # [C >= k], ascending ids
    best = torch.sort(values[candidates], descending=True, stable=True).indices[:k]  # [k]
    return candidates[best]


def top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k most likely tokens (ties to the lower id).

    Args:
        probs: `[V]` probabilities.
        top_k: how many to keep; 0 or -1 keeps all.
    Returns:
        `[V]` probabilities with the rest zeroed and renormalised.
    """
    if top_k <= 0 or top_k >= probs.numel():
        return probs
    kept_ids = top_ids(probs, top_k)  # [top_k]
    kept = torch.zeros_like(probs)
    kept[kept_ids] = probs[kept_ids]
    return kept / kept.sum()


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


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens at least min_p times as likely as the most likely one.

    Args:
        probs: `[V]` probabilities.
        min_p: in [0, 1]; 0 keeps all.
    Returns:
        `[V]` probabilities with the rest zeroed and renormalised.
    """
    if min_p <= 0.0:
        return probs
    kept = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return kept / kept.sum()


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The sampled token's logprob and the k most likely tokens' (most likely first, ties to the lower id).

    Args:
        logits: `[V]` float32, the raw logits (before penalties and temperature).
        token: the sampled token.
        k: how many of the most likely to list.
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [V]
    k = min(k, logprobs.numel())
    if k == 0:
        return TokenLogprobs(float(logprobs[token]), [], [])
    ids = top_ids(logprobs, k)  # [k]
    return TokenLogprobs(float(logprobs[token]), ids.tolist(), logprobs[ids].tolist())


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           history: TokenHistory | None = None) -> Sampled:
    """Pick the next token.

    Args:
        logits: `[V]` float32 for one sequence.
        params: temperature 0 means greedy (argmax of the penalised logits, ties to the lowest id).
        generator: the request's generator (from `make_generator`); None uses torch's global RNG.
        history: the sequence's tokens so far (`TokenHistory.start`, then `record`); None: none yet,
            and no EOS known.
    Returns:
        The token id, and its logprobs when params.logprobs is set.
    Raises:
        ValueError: invalid params, logits that are not one row, or a history without the tensors a
            penalty needs.
    """
    check_params(params)
    if logits.dim() != 1:
        raise ValueError(f"expected logits [V], got {tuple(logits.shape)}")
    raw = logits.float().cpu()  # [V]
    if history is None:
        history = TokenHistory.start([], params, raw.numel())
    processed = ban_stop_tokens(apply_penalties(raw, params, history), params, history)  # [V]
    if params.temperature == 0:
        token = int(torch.argmax(processed))
    else:
        probs = torch.softmax(processed / params.temperature, dim=-1)  # [V]
        probs = min_p_filter(top_p_filter(top_k_filter(probs, params.top_k), params.top_p), params.min_p)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return Sampled(token, token_logprobs(raw, token, params.logprobs) if params.logprobs is not None else None)
