"""vLLM's own KV event structs, encoded as its ZMQ publisher encodes them, decode into kvwire's mirror of them
(router/kv_events.py); a publisher on a real server runs in test_pd_schedule.py."""

from __future__ import annotations

import msgspec
import pytest

from kvwire.router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

kv_events = pytest.importorskip("vllm.distributed.kv_events")


def test_vllms_batches_decode():
    batch = kv_events.KVEventBatch(ts=1.5, events=[
        kv_events.BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=None, token_ids=list(range(256)),
                              block_size=128, lora_id=None, medium="GPU", lora_name=None),
        kv_events.BlockStored(block_hashes=[9], parent_block_hash=7, token_ids=list(range(128)), block_size=128,
                              lora_id=None, medium="CPU", lora_name=None, group_idx=1),
        kv_events.BlockRemoved(block_hashes=[7], medium="GPU"),
        kv_events.AllBlocksCleared(),
    ], data_parallel_rank=0)
    got = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert got.events == [BlockStored([b"\x01" * 32, 7], None, list(range(256)), 128),
                          BlockStored([9], 7, list(range(128)), 128, group_idx=1), BlockRemoved([7]),
                          AllBlocksCleared()]


def test_an_adapter_s_and_a_salt_s_blocks_decode_into_their_cache_scope():
    """vLLM's own extra keys of a LoRA request with a cache_salt, and of an image's block, as its block pool
    publishes them (`to_event_extra_keys` of `generate_block_hash_extra_keys`' tagged keys)."""
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    from kvwire.engine.block_names import ROOT
    from kvwire.router.vllm.cache_scope import scope, stored_scope

    keys = to_event_extra_keys([(("lora", "sql", "/adapters/sql"), ("cache_salt", "tenant-a")),
                                (("lora", "sql", "/adapters/sql"),)])
    adapter = kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)),
                                    block_size=16, lora_id=1, medium="GPU", lora_name="sql", extra_keys=keys)
    image = kv_events.BlockStored(block_hashes=[3, 4], parent_block_hash=None, token_ids=list(range(32)),
                                  block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                  extra_keys=to_event_extra_keys([None, (("mm", "img-hash", 0),)]))
    got = decode_batch(msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.0, events=[adapter, image])))
    assert [stored_scope(e) for e in got.events] == [(scope("sql", "tenant-a"), 2), (ROOT, 1)]
