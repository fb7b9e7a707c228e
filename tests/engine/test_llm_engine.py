"""The continuous-batching loop: admission, block accounting, abort, batch-independent output, and how
the sampling params end a request (EOS, stop ids, min_tokens, ignore_eos) and report its logprobs."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.base import KVConnectorBase
from kvwire.connectors.kv_pool import KVPool
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.llm_engine import InvalidRequest, LLMEngine
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import kv_layout
from kvwire.engine.reference import generate, generate_with_logprobs
from kvwire.engine.runner import ModelRunner
from kvwire.engine.sequence import FinishReason
from kvwire.protocol.work import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


_MODEL_EOS = object()


def _engine(model, num_blocks=32, block_size=4, max_len=256, eos=_MODEL_EOS) -> LLMEngine:
    pool = KVPool.allocate(kv_layout(model.config, block_size), num_blocks)
    eos_id = model.config.eos_token_id if eos is _MODEL_EOS else eos
    return LLMEngine(ModelRunner(model, pool), BlockAllocator(num_blocks), max_len, eos_id)


def _run(engine: LLMEngine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 1000
    return steps


def test_outputs_do_not_depend_on_what_else_is_batched(model):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[65, 66, 67], list(range(30, 50)), [1]]
    alone = []
    for p in prompts:
        eng = _engine(model)
        seq = eng.add_request("x", p, params)
        _run(eng)
        alone.append(seq.output_ids)
    eng = _engine(model)
    seqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    _run(eng)
    assert [s.output_ids for s in seqs] == alone
    assert all(len(o) == 6 for o in alone)


def test_blocks_return_to_the_pool_and_admission_waits_for_room(model):
    eng = _engine(model, num_blocks=6, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    a = eng.add_request("a", list(range(10, 22)), params)  # 16 tokens -> 4 blocks
    b = eng.add_request("b", list(range(40, 52)), params)  # does not fit beside a
    eng.step()
    assert [s.request_id for s in eng.running] == ["a"] and list(eng.waiting) == [b]
    assert eng.allocator.num_free == 2
    _run(eng)
    assert a.finished and b.finished and len(b.output_ids) == 4
    assert eng.allocator.num_free == 6
    m = b.metrics
    assert m.time_in_queue > 0 and m.ttft >= m.time_in_queue  # b waited for a's blocks
    assert m.finished_time >= m.first_token_time >= m.first_scheduled_time >= m.arrival_time
    assert m.model_execute_time >= m.model_forward_time > 0


def test_abort_frees_blocks_at_once(model):
    eng = _engine(model)
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0))
    eng.add_request("b", [8, 9], SamplingParams(max_tokens=50, temperature=0.0))
    eng.step()
    eng.abort("a")
    eng.abort("b")
    assert not eng.has_unfinished() and eng.allocator.num_free == 32


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([10**6], SamplingParams(), "token ids"),
    ([1], SamplingParams(max_tokens=0), "max_tokens"),
    ([1] * 250, SamplingParams(max_tokens=10), "context length"),
    ([1], SamplingParams(top_k=-2), "top_k"),
    ([1], SamplingParams(min_tokens=20), "min_tokens"),
    ([1], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ([1], SamplingParams(logprobs=50), "logprobs"),
])
def test_invalid_requests_are_refused_before_queueing(model, prompt, params, match):
    eng = _engine(model)
    with pytest.raises(InvalidRequest, match=match):
        eng.add_request("bad", prompt, params)
    assert not eng.has_unfinished()


def test_request_larger_than_the_pool_is_refused(model):
    eng = _engine(model, num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequest, match="more KV blocks"):
        eng.add_request("big", list(range(20)), SamplingParams(max_tokens=4))


PROMPT = [65, 66, 67]


@pytest.fixture(scope="module")
def greedy(model) -> list[int]:
    """PROMPT's greedy continuation, with no EOS to stop it."""
    eng = _engine(model, eos=None)
    seq = eng.add_request("g", PROMPT, SamplingParams(max_tokens=8))
    _run(eng)
    assert seq.finish_reason == FinishReason.LENGTH and len(seq.output_ids) == 8
    return seq.output_ids


def _alone(model, params: SamplingParams, eos=None):
    eng = _engine(model, eos=eos)
    seq = eng.add_request("x", PROMPT, params)
    _run(eng)
    assert eng.allocator.num_free == 32
    return seq


def test_a_stop_token_id_finishes_with_stop(model, greedy):
    stop, never = greedy[2], min(set(range(model.config.vocab_size)) - set(greedy))
    seq = _alone(model, SamplingParams(max_tokens=8, stop_token_ids=[never, stop]))
    assert seq.output_ids == greedy[: greedy.index(stop) + 1] and seq.finish_reason == FinishReason.STOP


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_off(model, greedy):
    eos = greedy[0]
    stopped = _alone(model, SamplingParams(max_tokens=8), eos=eos)
    assert stopped.output_ids == [eos] and stopped.finish_reason == FinishReason.STOP
    ignored = _alone(model, SamplingParams(max_tokens=8, ignore_eos=True), eos=eos)
    assert ignored.output_ids == greedy and ignored.finish_reason == FinishReason.LENGTH
    held = _alone(model, SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[greedy[1]]), eos=eos)
    assert not {eos, greedy[1]} & set(held.output_ids[:3])
    stops = [i for i, t in enumerate(held.output_ids) if t in (eos, greedy[1])]
    assert stops in ([], [len(held.output_ids) - 1])  # the first stop token after min_tokens ends it
    assert held.finish_reason == (FinishReason.STOP if stops else FinishReason.LENGTH)


def test_penalties_are_counted_as_tokens_come(model, greedy):
    seq = _alone(model, SamplingParams(max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5))
    h = seq.history
    assert h.num_output == 8 and h.output_counts is not None and h.in_prompt is not None
    counted = torch.bincount(torch.tensor(seq.output_ids), minlength=model.config.vocab_size).float()  # [V]
    assert torch.equal(h.output_counts, counted)
    assert torch.nonzero(h.in_prompt).flatten().tolist() == PROMPT


def test_logprobs_come_with_each_step(model, greedy):
    eng = _engine(model, eos=None)
    seq = eng.add_request("lp", PROMPT, SamplingParams(max_tokens=4, logprobs=3))
    plain = eng.add_request("plain", PROMPT, SamplingParams(max_tokens=4))
    per_step = []
    while eng.has_unfinished():
        for out in eng.step():
            assert len(out.new_logprobs) == (len(out.new_token_ids) if out.sequence is seq else 0)
            per_step += out.new_logprobs
    assert seq.output_ids == plain.output_ids == greedy[:4] and not plain.logprobs
    assert per_step == seq.logprobs and len(seq.logprobs) == 4
    for token, lp in zip(seq.output_ids, seq.logprobs):
        assert lp.top_ids[0] == token and lp.logprob == lp.top_logprobs[0]  # greedy: the most likely
        assert len(lp.top_ids) == 3 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_reference_generates_logprobs_too(tiny_model_dir, greedy):
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=5, logprobs=1)
    (ids, logprobs), = generate_with_logprobs(tiny_model_dir, [PROMPT], params)
    assert generate(tiny_model_dir, [PROMPT], params) == [ids]
    assert len(logprobs) == len(ids) and all(len(lp.top_ids) == 1 for lp in logprobs)


def _cached_engine(model, num_blocks=32) -> LLMEngine:
    pool = KVPool.allocate(kv_layout(model.config, 4), num_blocks)
    return LLMEngine(ModelRunner(model, pool), BlockAllocator(num_blocks), 256, model.config.eos_token_id,
                     prefix_cache=True)


def test_prefix_cache_computes_only_the_uncached_rest_and_answers_as_without(model):
    """A conversation's second turn (its first prompt + answer + more) starts on the first turn's cached blocks;
    its tokens equal an engine's without the cache. Cached blocks go back to the pool's free count."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = list(range(30, 49))  # 19 tokens: 4 full blocks of 4
    eng = _cached_engine(model)
    turn1 = eng.add_request("t1", first, params, receive_kv=False)
    _run(eng)
    assert turn1.num_cached_tokens == 0
    second = first + turn1.output_ids + [7, 8, 9]  # 28 tokens; 24 of them have KV in the cache
    turn2 = eng.add_request("t2", second, params, receive_kv=False)
    _run(eng)
    assert turn2.num_cached_tokens == 24
    plain = _engine(model)
    uncached = plain.add_request("t2", second, params)
    _run(plain)
    assert turn2.output_ids == uncached.output_ids
    again = eng.add_request("t3", list(second), params, receive_kv=False)  # all cached: its last block is computed
    _run(eng)
    assert again.num_cached_tokens == 24 and again.output_ids == turn2.output_ids
    assert eng.allocator.num_free == 32 and eng.allocator.num_cached > 0


class _Receiver(KVConnectorBase):
    """A consumer that "pulls" by computing what it is asked into the engine's blocks (a unit test's stand-in),
    recording each ask; `tails`: whether it takes a prompt's tail."""

    def __init__(self, model, tails: bool):
        self.model, self.tails, self.asked = model, tails, []

    @property
    def receives_tails(self) -> bool:
        return self.tails

    def close(self) -> None:
        pass

    def send_kv_caches_and_hidden_states(self, *args) -> None:
        raise AssertionError("a consumer does not send")

    def recv_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches):
        self.asked.append(model_input.sequences[0])
        return self.model(model_input, kv_caches), True, model_input


@pytest.mark.parametrize("tails", [False, True])
def test_a_received_prompt_starts_on_cached_blocks_only_where_its_connector_pulls_tails(model, tails):
    """A prompt whose KV is received starts on its cached prefix, and only its tail is asked for, when the
    connector takes tails; a connector that pulls whole prompts gets the whole prompt, into fresh blocks. Either
    way it answers as an engine without the cache."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    receiver = _Receiver(model, tails)
    pool = KVPool.allocate(kv_layout(model.config, 4), 32)
    eng = LLMEngine(ModelRunner(model, pool, consumer=receiver), BlockAllocator(32), 256,
                    model.config.eos_token_id, prefix_cache=True)
    first = eng.add_request("a", list(range(20)), params, receive_kv=False)
    eng.step()
    cached = first.block_ids[:5]  # its prompt's full blocks, named once computed
    _run(eng)
    pulled = eng.add_request("b", list(range(20)) + [3, 4, 5], params)
    _run(eng)
    asked = receiver.asked[-1]
    if tails:  # 20 of its 23 tokens cached: the first prompt's 5 full blocks
        assert pulled.num_cached_tokens == 20 and asked.start_pos == 20 and asked.token_ids == [3, 4, 5]
        assert asked.prompt_ids == list(range(20)) + [3, 4, 5] and asked.block_ids[:5] == cached
    else:
        assert pulled.num_cached_tokens == 0 and asked.start_pos == 0 and asked.prompt_ids is None
        assert not set(asked.block_ids) & set(cached)
    plain = _engine(model)
    alone = plain.add_request("b", list(range(20)) + [3, 4, 5], params)
    _run(plain)
    assert pulled.output_ids == alone.output_ids
