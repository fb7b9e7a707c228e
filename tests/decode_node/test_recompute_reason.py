"""Which prompts a decode node counts as recomputed (kvwire_recomputes_total): those that should have come as KV,
by why they did not; not those the router kept on decode by design."""

from __future__ import annotations

import pytest

from kvwire.decode_node.server import recompute_reason
from kvwire.observability.labels import PathReason, RecomputeReason
from kvwire.protocol.work import DecodeWork, SamplingParams


def _work(prefill_node: str = "", path_reason: PathReason | None = None) -> DecodeWork:
    return DecodeWork(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(), prefill_node=prefill_node,
                      reply_to="tcp://127.0.0.1:1", path_reason=path_reason)


@pytest.mark.parametrize("path, want", [
    (PathReason.PREFILLED, RecomputeReason.KV_NOT_RECEIVED),
    (None, RecomputeReason.KV_NOT_RECEIVED),  # an older router
])
def test_kv_asked_of_a_prefill_node_that_never_came(path, want):
    assert recompute_reason(_work("prefill-0", path)) == want


@pytest.mark.parametrize("path, want", [
    (PathReason.NO_PREFILL_INSTANCE, RecomputeReason.NO_PREFILL_NODE),
    (PathReason.PREFILL_SATURATED, RecomputeReason.PREFILL_SATURATED),
    (PathReason.PREFILL_OTHER_MODEL, RecomputeReason.PREFILL_OTHER_MODEL),
    (PathReason.PREFILL_OTHER_BLOCK_SIZE, RecomputeReason.PREFILL_OTHER_BLOCK_SIZE),
    # a later choice that could not start from its first one's prompt (one that could is never asked: the node
    # counts only prompts it computed)
    (PathReason.PROMPT_SHARED, RecomputeReason.PROMPT_NOT_SHARED),
    (None, RecomputeReason.NO_PREFILL_NODE),  # an older router says nothing: as before
    (PathReason.SHORT_PROMPT, None), (PathReason.CACHED_ON_DECODE, None), (PathReason.NOT_ASKED, None),
])
def test_decode_only_is_a_recompute_unless_chosen(path, want):
    assert recompute_reason(_work("", path)) == want


def test_a_prompt_kept_here_as_cached_whose_blocks_were_not_in_the_cache_is_a_prefix_miss():
    """The router kept it here predicting 32 of its 40 tokens in the prefix cache (blocks of 16): fewer found is a
    miss; a cache gives whole blocks short of the prompt's last token, so 32 of a 33-token prompt is not asked."""
    def work(prompt_len: int, expected: int) -> DecodeWork:
        return DecodeWork(request_id="r", prompt_token_ids=[1] * prompt_len, sampling=SamplingParams(),
                          prefill_node="", reply_to="tcp://127.0.0.1:1", path_reason=PathReason.CACHED_ON_DECODE,
                          cached_expected=expected)

    assert recompute_reason(work(40, 32), 16, 16) == RecomputeReason.PREFIX_MISS
    assert recompute_reason(work(40, 32), 0, 16) == RecomputeReason.PREFIX_MISS
    assert recompute_reason(work(40, 32), 32, 16) is None
    assert recompute_reason(work(32, 32), 16, 16) is None  # its last block holds its last token: computed
    assert recompute_reason(work(33, 32), 32, 16) is None
