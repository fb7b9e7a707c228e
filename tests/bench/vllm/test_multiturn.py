"""The multi-turn workload of `kvwire bench vllm --workload multiturn`, and how its figures are made (the servers
themselves run in the bench, by hand: docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from kvwire.bench.vllm.multiturn import (
    MultiturnConfig,
    Row,
    Servers,
    TurnSample,
    _delta,
    _messages,
    _scripts,
    _stayed,
)
from kvwire.cluster.vllm_cluster import VLLMServer

CFG = MultiturnConfig(Path("m"), "redis://x", Path("l"), conversations=2, turns=3, shorts=3, system_tokens=50,
                      user_tokens=10, short_tokens=20)


def test_each_row_has_prompts_of_its_own_and_short_prompts_fall_between_conversations():
    scripts = _scripts(Row.SCHEDULER, CFG)
    assert [s.tag for s in scripts] == ["ks-c0", "ks-s0", "ks-c1", "ks-s1", "ks-s2"]
    assert all(len(s.users) == 3 and s.system and len(s.system) == 50 for s in scripts if "-c" in s.tag)
    assert all(len(s.users) == 1 and s.system is None for s in scripts if "-s" in s.tag)
    other = _scripts(Row.ROUND_ROBIN, CFG)
    assert not {s.system for s in scripts} & {s.system for s in other if s.system}


def test_a_turn_s_messages_carry_the_answers_given_before_it():
    script = _scripts(Row.PLAIN, CFG)[0]
    assert _messages(script, [], 0) == [{"role": "system", "content": script.system},
                                        {"role": "user", "content": script.users[0]}]
    third = _messages(script, ["a0", "a1"], 2)
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third if m["role"] == "assistant"] == ["a0", "a1"]


def test_prompt_tokens_by_what_happened_to_them_over_a_row():
    prefill, d1, d2 = (cast(VLLMServer, object()) for _ in range(3))
    servers = Servers(cast(VLLMServer, object()), prefill, [d1, d2], {})
    before = [{"local_compute": 0.0}, {"local_compute": 5.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0},
              {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}]
    after = [{"local_compute": 100.0}, {"local_compute": 15.0, "local_cache_hit": 40.0, "external_kv_transfer": 60.0},
             {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 40.0}]
    got = _delta(before, after, [prefill, d1, d2], servers)
    # the decode servers were asked 150 prompt tokens: 100 pulled, 40 found in their caches, 10 computed there
    assert got == {"prompt": 150.0, "computed": 110.0, "transferred": 100.0, "reused": 40.0}


def test_later_turns_count_as_staying_when_their_decode_server_is_the_first_turn_s():
    def turn(tag: str, decode: str) -> TurnSample:
        return TurnSample(tag, 1.0, 1, [], "decode-only", decode)

    samples = [turn("ks-c0-t0", "A"), turn("ks-c1-t0", "B"), turn("ks-c0-t1", "A"), turn("ks-c1-t1", "A"),
               turn("ks-s0-t0", "B")]
    assert _stayed(samples) == 0.5
    assert _stayed([turn("ks-s0-t0", "A")]) is None
