"""Greedy, seeded and nucleus sampling."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.wire import SamplingParams
from kvwire.engine.sampler import make_generator, sample, top_p_filter

LOGITS = torch.tensor([1.0, 3.0, 0.5, 2.9, -1.0, 0.0])


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, SamplingParams(temperature=0.0), None) == 1
    assert sample(torch.tensor([2.0, 5.0, 5.0]), SamplingParams(), None) == 1  # ties to the lowest id


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(LOGITS, params, gen) for _ in range(50)]

    a = draws(7)
    assert a == draws(7)
    assert a != draws(8)
    assert len(set(a)) >= 3  # temperature 1 really samples
    assert isinstance(make_generator(None), torch.Generator)


def test_top_p_excludes_low_probability_tokens() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])  # p ~ [0.72, 0.26, 0.005, ...]
    gen = make_generator(0)
    tokens = {sample(logits, SamplingParams(temperature=1.0, top_p=0.9), gen) for _ in range(300)}
    assert tokens == {0, 1}
    tokens = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(100)}
    assert tokens == {0}
    probs = top_p_filter(torch.softmax(logits, -1), 0.9)
    assert probs[2:].sum() == 0 and abs(float(probs.sum()) - 1.0) < 1e-6


def test_invalid_params_raise() -> None:
    with pytest.raises(ValueError, match="temperature"):
        sample(LOGITS, SamplingParams(temperature=-1.0), None)
    with pytest.raises(ValueError, match="top_p"):
        sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.0), None)
    with pytest.raises(ValueError, match="logits"):
        sample(LOGITS[None], SamplingParams(), None)
