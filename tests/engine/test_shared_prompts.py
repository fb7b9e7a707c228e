"""A request's later choices starting from its first choice's prompt KV (engine/shared_prompts.py): each answers
exactly as if it had computed the prompt alone, the prompt is computed once, every block comes back, and a later
choice whose first one ended early or was aborted itself loses nothing."""

from __future__ import annotations

import pytest

from kvwire.connectors.kv_pool import KVPool
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner
from kvwire.protocol.work import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


class CountingRunner(ModelRunner):
    """The real runner, counting the prompt tokens it computes."""

    prompt_tokens = 0

    def run_prompt(self, model_input, receive_kv=True):
        self.prompt_tokens += model_input.num_tokens
        return super().run_prompt(model_input, receive_kv)


def _engine(model, num_blocks=48, block_size=4) -> tuple[LLMEngine, CountingRunner]:
    runner = CountingRunner(model, KVPool.allocate(kv_layout(model.config, block_size), num_blocks))
    return LLMEngine(runner, BlockAllocator(num_blocks), 256, model.config.eos_token_id), runner


def _run(engine: LLMEngine) -> None:
    for _ in range(1000):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def _params(seed: int, max_tokens: int = 7) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=2)


def _alone(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list]:
    eng, _ = _engine(model)
    seq = eng.add_request("alone", prompt, params)
    _run(eng)
    return seq.output_ids, seq.logprobs


@pytest.mark.parametrize("prompt_len", [13, 16])  # a partial last block (copied for each), and none
def test_later_choices_answer_as_if_alone_and_the_prompt_is_computed_once(model, prompt_len):
    prompt = list(range(40, 40 + prompt_len))
    eng, runner = _engine(model)
    first = eng.add_request("r-0", prompt, _params(5))
    later = [eng.add_request(f"r-{k}", prompt, _params(5 + k), receive_kv=False, prompt_of="r-0") for k in (1, 2, 3)]
    outputs = eng.step()
    assert [o.sequence.request_id for o in outputs] == ["r-0", "r-1", "r-2", "r-3"]  # one step: every first token
    _run(eng)
    assert runner.prompt_tokens == prompt_len
    for k, seq in enumerate([first, *later]):
        assert (seq.output_ids, seq.logprobs) == _alone(model, prompt, _params(5 + k)), k
    assert [s.prompt_shared for s in later] == [True] * 3 and not first.prompt_shared
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_a_later_choice_added_before_its_first_choice_waits_for_it(model):
    """The decode node adds a later choice while its first one still waits outside the engine for its KV."""
    prompt = list(range(7, 30))
    eng, runner = _engine(model)
    later = eng.add_request("r-1", prompt, _params(2), receive_kv=False, prompt_of="r-0")
    assert not eng.can_step() and eng.has_unfinished() and eng.unfinished == [later]
    first = eng.add_request("r-0", prompt, _params(1))
    _run(eng)
    assert runner.prompt_tokens == len(prompt) and later.prompt_shared
    assert later.output_ids == _alone(model, prompt, _params(2))[0] and len(first.output_ids) == 7


def test_a_later_choice_waits_for_its_own_blocks_holding_the_prompts(model):
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks of 4 and a partial one
    eng, runner = _engine(model, num_blocks=12)
    first = eng.add_request("r-0", prompt, _params(1, max_tokens=10))  # 6 blocks
    other = eng.add_request("x", list(range(3, 20)), _params(9, max_tokens=4))  # 6 blocks: none left
    later = eng.add_request("r-1", prompt, _params(2, max_tokens=10), receive_kv=False, prompt_of="r-0")
    eng.step()
    assert later in eng.unfinished and not later.prompt_shared  # needs 3 blocks of its own; 0 free
    _run(eng)
    assert later.prompt_shared and runner.prompt_tokens == len(prompt) + 17
    assert later.output_ids == _alone(model, prompt, _params(2, max_tokens=10))[0]
    assert first.finished and other.finished and eng.allocator.num_free == 12


def test_a_first_choice_that_ends_before_its_prompt_leaves_its_later_ones_to_compute_it(model):
    prompt = list(range(20, 34))
    eng, runner = _engine(model)
    eng.add_request("r-0", prompt, _params(1))
    later = eng.add_request("r-1", prompt, _params(2), receive_kv=False, prompt_of="r-0")
    eng.abort("r-0")
    _run(eng)
    assert not later.prompt_shared and runner.prompt_tokens == len(prompt)
    assert later.output_ids == _alone(model, prompt, _params(2))[0]
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_a_later_choice_aborted_before_or_after_its_prompt_gives_everything_back(model):
    prompt = list(range(60, 73))
    eng, _ = _engine(model, num_blocks=10)
    eng.add_request("r-0", prompt, _params(1, max_tokens=20))  # 9 blocks of 10
    waiting = eng.add_request("r-1", prompt, _params(2), receive_kv=False, prompt_of="r-0")
    ready = eng.add_request("r-2", prompt, _params(3), receive_kv=False, prompt_of="r-0")
    eng.abort("r-1")  # still waiting for the prompt
    eng.step()  # r-0's prompt: r-2 holds its blocks, and waits for 2 of its own (1 free)
    assert eng.unfinished[-1] is ready and not ready.prompt_shared
    eng.abort("r-2")
    assert waiting not in eng.unfinished and ready not in eng.unfinished
    eng.abort("r-0")
    assert eng.allocator.num_free == 10 and not eng.has_unfinished()


def test_prompt_pending_is_true_only_until_the_first_token(model):
    eng, _ = _engine(model)
    eng.add_request("a", [1, 2, 3], _params(1))
    assert eng.prompt_pending("a") and not eng.prompt_pending("b")
    eng.step()
    assert not eng.prompt_pending("a")


def test_a_later_choice_waiting_for_blocks_is_not_overtaken_by_a_new_request(model):
    prompt = list(range(50, 63))
    eng, _ = _engine(model, num_blocks=12)
    eng.add_request("r-0", prompt, _params(1, max_tokens=10))  # 6 blocks
    eng.add_request("x", list(range(3, 20)), _params(9, max_tokens=4))  # 6 blocks
    later = eng.add_request("r-1", prompt, _params(2, max_tokens=10), receive_kv=False, prompt_of="r-0")
    eng.step()
    eng.add_request("small", list(range(100, 113)), _params(4, max_tokens=1))  # 4 blocks: r-1 needs 3
    order = []
    while eng.has_unfinished():
        order += [o.sequence.request_id for o in eng.step() if len(o.sequence.output_ids) == 1]
    assert order.index("r-1") < order.index("small") and later.prompt_shared


def test_len_counts_the_later_choices_not_started(model):
    prompt = list(range(20, 41))
    eng, _ = _engine(model)
    eng.add_request("r-0", prompt, _params(1))
    for k in (1, 2, 3):
        eng.add_request(f"r-{k}", prompt, _params(1 + k), receive_kv=False, prompt_of="r-0")
    eng.abort("r-3")
    assert len(eng.shared) == 2
    eng.step()
    assert len(eng.shared) == 0 and len(eng.running) == 3
