"""Greedy, seeded, nucleus, top-k and min-p sampling; the penalties, min_tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from kvwire.engine.sampler import (
    TokenHistory,
    apply_penalties,
    check_params,
    make_generator,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)
from kvwire.protocol.work import SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 0.5, 2.9, -1.0, 0.0])


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, SamplingParams(temperature=0.0), None) == (1, None)
    assert sample(torch.tensor([2.0, 5.0, 5.0]), SamplingParams(), None).token == 1  # ties to the lowest id


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(LOGITS, params, gen).token for _ in range(50)]

    a = draws(7)
    assert a == draws(7)
    assert a != draws(8)
    assert len(set(a)) >= 3  # temperature 1 really samples
    assert isinstance(make_generator(None), torch.Generator)


def test_top_p_excludes_low_probability_tokens() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])  # p ~ [0.72, 0.26, 0.005, ...]
    gen = make_generator(0)
    tokens = {sample(logits, SamplingParams(temperature=1.0, top_p=0.9), gen).token for _ in range(300)}
    assert tokens == {0, 1}
    tokens = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen).token for _ in range(100)}
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


def _history(params: SamplingParams, prompt: list[int], output: list[int], eos: int | None = None) -> TokenHistory:
    history = TokenHistory.start(prompt, params, len(LOGITS), eos)
    for t in output:
        history.record(t)
    return history


PROMPT, OUTPUT = [4], [1, 1, 3]  # token 1 twice and 3 once in the output, 4 in the prompt only


@pytest.mark.parametrize("params, expected", [
    # repetition: seen tokens (1, 3, 4) divide a positive logit by 2, multiply a negative one by 2
    (SamplingParams(repetition_penalty=2.0), [1.0, 1.5, 0.5, 1.45, -2.0, 0.0]),
    # frequency: minus 0.5 per occurrence in the output (prompt tokens not counted)
    (SamplingParams(frequency_penalty=0.5), [1.0, 2.0, 0.5, 2.4, -1.0, 0.0]),
    # presence: minus 0.5 once for each token in the output
    (SamplingParams(presence_penalty=0.5), [1.0, 2.5, 0.5, 2.4, -1.0, 0.0]),
    # all three, in that order: 3.0 / 2 - 0.5 * 2 - 0.5 = 0; 2.9 / 2 - 0.5 - 0.5 = 0.45
    (SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.5),
     [1.0, 0.0, 0.5, 0.45, -2.0, 0.0]),
    (SamplingParams(frequency_penalty=-1.0), [1.0, 5.0, 0.5, 3.9, -1.0, 0.0]),  # negative: encourages repeats
])
def test_penalties_follow_the_formulas(params, expected) -> None:
    before = LOGITS.clone()
    got = apply_penalties(LOGITS, params, _history(params, PROMPT, OUTPUT))
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6), got
    assert torch.equal(LOGITS, before)  # the caller's logits are left alone


def test_penalties_steer_greedy_and_need_a_counting_history() -> None:
    params = SamplingParams(presence_penalty=1.0)
    assert sample(LOGITS, params, None, _history(params, [], [1])).token == 3  # 3.0 - 1 < 2.9
    assert sample(LOGITS, SamplingParams(), None, _history(SamplingParams(), [], [1])).token == 1
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(LOGITS, params, None, _history(SamplingParams(), [], [1]))  # started without counts


def test_history_counts_only_what_a_penalty_needs() -> None:
    assert _history(SamplingParams(), [0, 2], [1]).output_counts is None
    h = _history(SamplingParams(repetition_penalty=1.2), [0, 2, 2], [1, 1, 5])
    assert h.num_output == 3 and h.output_counts is not None and h.in_prompt is not None
    assert h.output_counts.tolist() == [0, 2, 0, 0, 0, 1] and h.in_prompt.tolist() == [1, 0, 1, 0, 0, 0]
    assert _history(SamplingParams(frequency_penalty=0.1), [0], []).in_prompt is None


def test_top_k_and_min_p_keep_the_right_tokens() -> None:
    probs = torch.softmax(LOGITS, -1)  # order: 1, 3, 0, 2, 5, 4
    assert torch.nonzero(top_k_filter(probs, 2)).flatten().tolist() == [1, 3]
    assert abs(float(top_k_filter(probs, 2).sum()) - 1) < 1e-6
    assert top_k_filter(probs, 0) is probs and top_k_filter(probs, -1) is probs
    assert torch.nonzero(top_k_filter(torch.full((4,), 0.25), 2)).flatten().tolist() == [0, 1]  # ties: lower ids
    # min_p: p / p_max = exp(logit - 3): token 3 at 0.90, token 0 at 0.135, token 2 at 0.082
    assert torch.nonzero(min_p_filter(probs, 0.5)).flatten().tolist() == [1, 3]
    assert torch.nonzero(min_p_filter(probs, 0.1)).flatten().tolist() == [0, 1, 3]
    assert min_p_filter(probs, 0.0) is probs
    gen = make_generator(0)
    for params, allowed in [(SamplingParams(temperature=1.0, top_k=2), {1, 3}),
                            (SamplingParams(temperature=1.0, min_p=0.1), {0, 1, 3}),
                            (SamplingParams(temperature=1.0, top_k=3, min_p=0.5), {1, 3})]:
        assert {sample(LOGITS, params, gen).token for _ in range(200)} == allowed


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    params = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[3])
    assert sample(LOGITS, params, None, _history(params, [0], [], eos=1)).token == 0  # not 1 (EOS) nor 3
    assert sample(LOGITS, params, None, _history(params, [0], [5], eos=1)).token == 0
    assert sample(LOGITS, params, None, _history(params, [0], [5, 5], eos=1)).token == 1  # two out: free again
    gen, hot = make_generator(3), SamplingParams(min_tokens=1, temperature=1.0, stop_token_ids=[3])
    drawn = {sample(LOGITS, hot, gen, _history(hot, [0], [], eos=1)).token for _ in range(200)}
    assert drawn == {0, 2, 4, 5}  # 1 and 3, the two most likely, never


def test_logprobs_are_of_the_raw_logits() -> None:
    params = SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.5, logprobs=3, seed=1)
    token, lp = sample(LOGITS, params, make_generator(1), _history(params, PROMPT, OUTPUT))
    raw = torch.log_softmax(LOGITS, -1)
    assert lp is not None and lp.top_ids == [1, 3, 0]  # most likely first
    assert lp.logprob == pytest.approx(float(raw[token]))
    assert lp.top_logprobs == pytest.approx(raw[[1, 3, 0]].tolist())
    tied = sample(torch.tensor([2.0, 5.0, 5.0, 1.0]), SamplingParams(logprobs=2), None).logprobs
    assert tied is not None and tied.top_ids == [1, 2]  # ties to the lower id
    none = sample(LOGITS, SamplingParams(logprobs=0), None).logprobs
    assert none is not None and none.top_ids == [] and none.logprob == pytest.approx(float(raw[1]))
    assert sample(LOGITS, SamplingParams(), None).logprobs is None


def test_seeded_sampling_with_every_knob_is_reproducible() -> None:
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.95, min_p=0.05, presence_penalty=0.3,
                            frequency_penalty=0.2, repetition_penalty=1.1, logprobs=2, seed=11)

    def draws(seed: int) -> list[int]:
        gen, history = make_generator(seed), _history(params, PROMPT, [])
        out = []
        for _ in range(40):
            token = sample(LOGITS, params, gen, history).token
            history.record(token)
            out.append(token)
        return out

    assert draws(11) == draws(11) and draws(11) != draws(12)


def test_defaults_draw_exactly_as_before() -> None:
    """The path with every new field at its default: the same ops and generator draws as before they existed."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gen_new, gen_old = make_generator(5), make_generator(5)
    new = [sample(logits, params, gen_new, _history(params, [1, 2], [])).token for _ in range(50)]
    old = [int(torch.multinomial(top_p_filter(torch.softmax(logits / 0.8, -1), 0.9), 1, generator=gen_old))
           for _ in range(50)]
    assert new == old


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"), (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature=float("nan")), "temperature"),
])
def test_out_of_range_params_raise(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_params(SamplingParams(**bad))  # max_tokens 16
    check_params(SamplingParams(top_k=-1, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, min_tokens=16,
                                logprobs=20, stop_token_ids=[0]))  # the edges are fine
