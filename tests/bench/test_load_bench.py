"""`kvwire bench load` at a small size: a real cluster under concurrent clients, nothing lost, memory back."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvwire.bench.load import (
    Drained,
    LoadConfig,
    LoadResult,
    Outcome,
    PoolState,
    ProcessMemory,
    _Sample,
    bench_load,
    build_workload,
    prompt_mix,
    summarize,
    table,
)
from kvwire.bench.prompts import PROMPTS
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.protocol.work import SamplingParams


def test_prompt_mix_is_deterministic_and_varied(tmp_path):
    cfg = LoadConfig(model_dir=tmp_path, distinct_prompts=40, max_prompt_chars=600, seed=3)
    mix = prompt_mix(cfg)
    assert mix == prompt_mix(cfg) and mix != prompt_mix(dataclasses.replace(cfg, seed=4))
    assert mix[: len(PROMPTS)] == PROMPTS and len(mix) == 40
    extra = mix[len(PROMPTS):]
    assert all(s.isascii() and 1 <= len(s) <= 600 for s in extra)
    assert max(map(len, extra)) > 300 and min(map(len, extra)) < 300  # a spread of lengths, not one size


def test_config_rejects_a_mix_smaller_than_the_demo_prompts(tmp_path):
    with pytest.raises(ValueError, match="distinct_prompts"):
        LoadConfig(model_dir=tmp_path, distinct_prompts=len(PROMPTS) - 1)


def test_summary_fails_unless_everything_answered_and_memory_returned(tmp_path):
    cfg = LoadConfig(model_dir=tmp_path, requests=2, rss_tolerance_mib=64.0)
    samples = [_Sample(Outcome.OK, 10.0, 5.0, 8, True), _Sample(Outcome.OK, 20.0, 6.0, 8, True)]
    full = [PoolState(NodeRole.PREFILL, 16, 16, 0), PoolState(NodeRole.DECODE, 16, 16, 0)]
    idle = Drained(full, [], 0, [], 1.0)
    calm, grown = [ProcessMemory("decode", 300.0, 310.0, 10.0)], [ProcessMemory("decode", 300.0, 400.0, 100.0)]
    good = summarize(cfg, samples, 1.0, idle, calm)
    assert good.passed and (good.ok, good.bypassed, good.throughput_tok_s, good.latency_ms_p50) == (2, 2, 16.0, 10.0)
    assert not summarize(cfg, samples, 1.0, idle, grown).memory_returned
    assert not summarize(cfg, samples, 1.0, Drained(full, [], 1, ["req-1"], 80.0), calm).passed  # tombstone kept
    assert not summarize(cfg, samples, 1.0, Drained(full, ["req-1"], 0, [], 1.0), calm).passed  # KV never pulled
    leaked = [PoolState(NodeRole.PREFILL, 16, 15, 1), full[1]]
    assert not summarize(cfg, samples, 1.0, Drained(leaked, [], 0, [], 30.0), calm).passed
    lost = summarize(cfg, [samples[0], _Sample(Outcome.LOST, 5.0, detail="ReadTimeout")], 1.0, idle, calm)
    assert (lost.ok, lost.lost, lost.passed, lost.error_samples) == (1, 1, False, ["ReadTimeout"])
    wrong = summarize(cfg, [samples[0], _Sample(Outcome.MISMATCH, 5.0, 1.0, 8, True, "got")], 1.0, idle, calm)
    assert (wrong.mismatched, wrong.bypassed, wrong.passed) == (1, 2, False)


@pytest.mark.slow
def test_small_load_loses_nothing_and_memory_returns(tiny_model_dir):
    cfg = LoadConfig(model_dir=tiny_model_dir, connector=ConnectorKind.TCP, requests=64, concurrency=16,
                     max_tokens=6, distinct_prompts=24, num_blocks=256)
    result = bench_load(cfg)
    assert (result.sent, result.ok, result.errors, result.lost, result.mismatched) == (64, 64, 0, 0, 0), \
        result.error_samples
    assert result.bypassed == 64  # every prompt's KV moved; none recomputed on decode
    assert result.pools_full and all(p.free == p.total == 256 and p.used == 0 for p in result.pools)
    assert {p.node for p in result.pools} == {NodeRole.PREFILL, NodeRole.DECODE}
    assert result.directory.live_entries == [] and result.directory.entries_left == []
    assert {m.process for m in result.memory} == {"prefill", "decode", "router"}
    assert all(m.growth_mib <= cfg.rss_tolerance_mib for m in result.memory)
    assert result.memory_returned and result.passed
    assert 0 < result.ttft_ms_p50 <= result.ttft_ms_p99 and 0 < result.latency_ms_p50 <= result.latency_ms_p99
    assert result.throughput_rps > 0 and result.throughput_tok_s > 0
    assert msgspec.json.decode(msgspec.json.encode(result), type=LoadResult) == result
    assert "passed: yes" in table(result)


def test_workload_references_match_each_prompt_run_alone(tiny_model_dir):
    from kvwire.engine.reference import generate
    from kvwire.engine.tokenizer import load_tokenizer

    cfg = LoadConfig(model_dir=tiny_model_dir, requests=20, distinct_prompts=10, max_tokens=3, max_prompt_chars=50)
    work = build_workload(cfg)
    assert len(work.expected) == len(work.prompts) == 10 and all(1 <= len(out) <= 3 for out in work.expected)
    assert sorted(work.order) == sorted(i % 10 for i in range(20)) and work.order != sorted(work.order)
    tokenizer, params = load_tokenizer(tiny_model_dir), SamplingParams(max_tokens=3, temperature=0.0)
    for i in (0, 9):  # batched with the others or alone: the same tokens
        assert generate(tiny_model_dir, [tokenizer.encode(work.prompts[i])], params) == [work.expected[i]]
