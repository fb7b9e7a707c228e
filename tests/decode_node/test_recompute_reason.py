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
