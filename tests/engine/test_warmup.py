"""A node's warm-up (engine/warmup.py) leaves the allocator, the pool, the prefix cache and the metrics exactly as
they were, is bounded by its budget, and changes no later request's tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from kvwire.connectors.kv_pool import KVPool
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner
from kvwire.engine.warmup import MAX_PASSES, warm_up
from kvwire.observability.metrics import process_metrics
from kvwire.protocol.work import SamplingParams

BS = 4


def _engine(model, num_blocks: int = 32, prefix_cache: bool = True) -> tuple[LLMEngine, ModelRunner]:
    """An engine and its runner (which a node warms up before it makes the engine)."""
    runner = ModelRunner(model, KVPool.allocate(kv_layout(model.config, BS), num_blocks))
    return LLMEngine(runner, BlockAllocator(num_blocks), 256, model.config.eos_token_id,
                     prefix_cache=prefix_cache), runner


def _allocator_state(allocator: BlockAllocator) -> dict:
    """Every table the allocator keeps (free set, users, idle order, names), copied."""
    return copy.deepcopy({k: v for k, v in vars(allocator).items() if k != "_lock"})


def _serve(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    seq = engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return seq.output_ids


def _kvwire_series() -> list[str]:
    """kvwire's own series (the process and GC collectors' move by themselves)."""
    return [line for line in process_metrics().exposition().decode().splitlines() if line.startswith("kvwire_")]


def test_warm_up_leaves_allocator_pool_and_metrics_exactly_as_they_were(tiny_model):
    engine, runner = _engine(tiny_model)
    held = engine.allocator.allocate(3)  # some blocks in use, so the free set is not just 0..n
    runner.pool.data.normal_()  # bytes in every block, the free ones included
    pool_before = runner.pool.data.clone()
    allocator_before = _allocator_state(engine.allocator)
    metrics_before = _kvwire_series()
    report = warm_up(runner, engine.allocator, engine.max_model_len)
    assert not report.skipped and 1 <= len(report.pass_ms) <= MAX_PASSES, report
    assert _allocator_state(engine.allocator) == allocator_before
    assert torch.equal(runner.pool.data, pool_before)
    assert engine.allocator.num_cached == 0  # no prefix-cache entry
    assert _kvwire_series() == metrics_before  # not counted as a request, nor as a forward
    engine.allocator.free(held)


def test_tokens_after_a_warm_up_are_those_of_a_cold_engine(tiny_model):
    prompt = list(range(40, 71))
    cold = _serve(_engine(tiny_model)[0], "cold", prompt)
    warm, warm_runner = _engine(tiny_model)
    warm_up(warm_runner, warm.allocator, warm.max_model_len)
    assert _serve(warm, "warm", prompt) == cold
    assert _serve(warm, "again", prompt) == cold  # from its prefix cache now: warm-up named nothing there


def test_warm_up_is_skipped_while_blocks_are_cached_or_too_few_are_free(tiny_model):
    engine, runner = _engine(tiny_model)
    _serve(engine, "r", list(range(1, 20)))  # leaves named blocks behind (the prefix cache)
    before = _allocator_state(engine.allocator)
    report = warm_up(runner, engine.allocator, engine.max_model_len)
    assert report.pass_ms == () and "cached" in report.skipped
    assert _allocator_state(engine.allocator) == before
    small, small_runner = _engine(tiny_model, num_blocks=3, prefix_cache=False)
    assert "free" in warm_up(small_runner, small.allocator, small.max_model_len).skipped


@pytest.mark.parametrize(("budget_s", "passes"), [(0.0, 1), (60.0, None)])
def test_no_pass_starts_once_the_budget_is_spent(tiny_model, budget_s, passes):
    engine, runner = _engine(tiny_model)
    report = warm_up(runner, engine.allocator, engine.max_model_len, budget_s=budget_s)
    if passes is not None:
        assert len(report.pass_ms) == passes
    else:
        assert 1 <= len(report.pass_ms) <= MAX_PASSES
    assert report.describe().startswith("warm-up: ")


@pytest.mark.parametrize("max_model_len", [1, 2, 3, 9])
def test_a_short_max_model_len_still_warms(tiny_model, max_model_len):
    engine, runner = _engine(tiny_model)
    before = _allocator_state(engine.allocator)
    report = warm_up(runner, engine.allocator, max_model_len)
    assert report.pass_ms and not report.skipped
    assert _allocator_state(engine.allocator) == before
