"""The continuous-batching loop: admission, block accounting, abort, and batch-independent output."""

from __future__ import annotations

import pytest

from kvwire.connectors.wire import SamplingParams
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.kv_cache import KVPool
from kvwire.engine.llm_engine import InvalidRequest, LLMEngine
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _engine(model, num_blocks=32, block_size=4, max_len=256) -> LLMEngine:
    pool = KVPool.allocate(kv_layout(model.config, block_size), num_blocks)
    return LLMEngine(ModelRunner(model, pool), BlockAllocator(num_blocks), max_len, model.config.eos_token_id)


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
