"""PrefixIndex: which instance holds which prompt prefix, in whole blocks, predicted from what it was sent."""

from __future__ import annotations

from kvwire.router.prefix_index import PrefixIndex, block_names

A, B = "http://a:1", "http://b:1"
BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_block_name_stands_for_its_whole_prefix():
    assert len(block_names(list(range(11)), BLOCK)) == 2  # full blocks only
    same_block_other_prefix = block_names([9, 9, 9, 9, 4, 5, 6, 7], BLOCK)
    assert block_names([0, 1, 2, 3, 4, 5, 6, 7], BLOCK)[1] != same_block_other_prefix[1]
    assert block_names([0, 1, 2, 3, 4, 5, 6, 7], BLOCK) == block_names([0, 1, 2, 3, 4, 5, 6, 7, 8], BLOCK)


def test_an_instance_holds_the_full_blocks_of_what_it_was_sent():
    index = PrefixIndex(BLOCK, ttl_s=60, clock=Clock())
    index.record(A, list(range(10)))  # blocks 0-3, 4-7; 8, 9 not a full block
    assert index.held(list(range(10)), [A, B]) == {A: 8, B: 0}
    assert index.held([*range(8), 50, 51, 52, 53], [A]) == {A: 8}  # a prompt that shares its first two blocks
    assert index.held([0, 1, 2, 3, 99, 5, 6, 7], [A]) == {A: 4}  # diverging in the second block
    assert index.held([1, 0, 2, 3, 4, 5, 6, 7], [A]) == {A: 0}


def test_the_next_turn_is_held_up_to_the_tokens_the_instance_generated():
    index = PrefixIndex(BLOCK, ttl_s=60, clock=Clock())
    turn1 = list(range(10))  # two full blocks and 8, 9
    index.record(A, turn1)
    index.answered(A, turn1, generated=5)  # the instance holds 10 + 5 tokens: three full blocks
    turn2 = [*turn1, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34]  # the answer, then the user's next message
    assert index.held(turn2, [A]) == {A: 12}
    other = [*turn1[:8], 7, 7, 20, 21, 22, 23]  # not a continuation of turn 1's last, partial block
    assert index.held(other, [A]) == {A: 8}
    assert index.held(turn1, [A]) == {A: 8}  # never more than the prompt, in whole blocks


def test_entries_lapse_after_the_ttl_and_are_renewed_by_recording():
    clock = Clock()
    index = PrefixIndex(BLOCK, ttl_s=60, clock=clock)
    prompt = list(range(8))
    index.record(A, prompt)
    clock.now += 59
    assert index.held(prompt, [A]) == {A: 8}
    index.record(A, prompt[:4])
    clock.now += 2  # the first block was renewed, the second was not
    assert index.held(prompt, [A]) == {A: 4}


def test_a_forgotten_instance_holds_nothing_and_the_others_keep_theirs():
    index = PrefixIndex(BLOCK, ttl_s=60, clock=Clock())
    prompt = list(range(8))
    index.record(A, prompt)
    index.record(B, prompt)
    index.answered(A, prompt, 3)
    index.forget(A)
    assert index.held(prompt, [A, B]) == {A: 0, B: 8}


def test_past_its_size_the_index_keeps_the_newest_entries():
    clock = Clock()
    index = PrefixIndex(1, ttl_s=600, clock=clock, max_entries=4)
    index.record(A, [1, 2])
    clock.now += 1
    index.record(B, [7, 8, 9])  # 5 entries: pruned to the newest record
    assert index.held([7, 8, 9], [B]) == {B: 3} and index.held([1, 2], [A]) == {A: 0}
