"""A batch's sequences: what a producer publishes of a prompt computed whole or past a cached prefix."""

from __future__ import annotations

import pytest

from kvwire.connectors.model_input import ModelInput, SequenceInput


def test_a_prompt_computed_past_a_cached_prefix_publishes_the_whole_prompt():
    whole = SequenceInput("a", [1, 2, 3, 4, 5], 0, [0, 1])
    tail = SequenceInput("b", [4, 5], 3, [0, 2], prompt_ids=[1, 2, 3, 4, 5])
    assert whole.whole_prompt() == [1, 2, 3, 4, 5] and tail.whole_prompt() == [1, 2, 3, 4, 5]
    assert (tail.num_tokens, tail.end_pos) == (2, 5)
    assert ModelInput([whole, tail]).token_slices() == [slice(0, 5), slice(5, 7)]


@pytest.mark.parametrize("prompt_ids", [None, [1, 2, 3, 4]])
def test_a_tail_without_its_whole_prompt_cannot_be_published(prompt_ids):
    with pytest.raises(ValueError, match="request b: tokens from 3 on, without the whole prompt"):
        SequenceInput("b", [4, 5], 3, [0, 2], prompt_ids=prompt_ids).whole_prompt()
