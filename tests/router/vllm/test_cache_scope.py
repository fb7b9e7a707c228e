"""Cache scopes: a prompt's blocks under another LoRA adapter, cache_salt or media are not held, as vLLM keys them."""

from __future__ import annotations

import asyncio

import httpx2
import msgspec

from kvwire.cluster.ports import free_port
from kvwire.connectors.config import NodeRole
from kvwire.engine.block_names import ROOT
from kvwire.router.config import RoutingPolicy
from kvwire.router.kv_events import BlockStored, decode_batch
from kvwire.router.vllm.cache_scope import LEARN_RETRY_S, ModelCards, scope, stored_scope
from kvwire.router.vllm.load import ServerLoad
from kvwire.router.vllm.pool import InstancePool
from kvwire.router.vllm.schedule import Scheduler
from tests.router.fake_vllm import FakeVLLM
from tests.router.test_kv_events import VBatch, VBlockStored

D1, D2 = "http://d1:1", "http://d2:1"
BLOCK = 4
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def cards(*base: str) -> ModelCards:
    made = ModelCards()
    made.base = frozenset(base)
    return made


def test_a_body_s_scope_is_its_adapter_its_salt_and_its_media():
    known = cards("llama", "llama-alias")
    chat = {"model": "llama", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert known.scope_of(chat) == ROOT  # the base model, text alone
    assert known.scope_of({"prompt": "hi"}) == known.scope_of({"model": "llama-alias", "prompt": "hi"}) == ROOT
    assert known.scope_of({"model": "sql", "prompt": "hi"}) == scope("sql", None) != ROOT  # an adapter
    assert known.scope_of({"model": "llama", "prompt": "hi", "cache_salt": "tenant-a"}) == scope(None, "tenant-a")
    assert scope(None, "tenant-a") not in (scope(None, "tenant-b"), scope("tenant-a", None))
    with_image = {"model": "llama", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]}
    assert known.scope_of(with_image) == scope(None, None, [IMAGE]) != ROOT
    tools = {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
             "tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}
    assert known.scope_of(tools) == ROOT  # a tool's schema is not a message's content
    agent = {"model": "llama", "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]},
                                            {"role": "user", "content": [{"type": "tool_result", "content": [
                                                {"type": "text", "text": "42"}]}]}]}
    assert known.scope_of(agent) == ROOT
    claude = {"model": "llama", "system": [{"type": "text", "text": "You are Claude Code.",
                                            "cache_control": {"type": "ephemeral"}}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                         "cache_control": {"type": "ephemeral"}}]}]}
    assert known.scope_of(claude) == ROOT  # a cache_control marker (which moves turn to turn) is no part
    called = {"model": "llama", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "id": "c1",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}]}
    assert known.scope_of(called) == ROOT  # a chat's tool calls are text to vLLM
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
    shown = {"model": "llama", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [picture]}]}]}
    assert known.scope_of(shown) == scope(None, None, [picture])  # an image in a tool's result is media


def test_before_the_base_model_s_names_are_known_a_named_model_is_a_scope_of_its_own():
    unknown = ModelCards()
    assert unknown.due()
    assert unknown.scope_of({"model": "llama", "prompt": "hi"}) == scope("llama", None)  # predicted uncached
    assert unknown.scope_of({"prompt": "hi"}) == ROOT


def test_an_instance_that_lists_no_names_is_said_once_and_asked_again_later(caplog):
    now = [0.0]
    known = ModelCards(clock=lambda: now[0])

    async def learn() -> None:
        async with httpx2.AsyncClient() as client:
            await known.learn(client, [f"http://127.0.0.1:{free_port()}"], {}, httpx2.Timeout(5.0))

    asyncio.run(learn())
    asyncio.run(learn())
    assert known.base is None and not known.due()
    assert [r.levelname for r in caplog.records if "base model's names" in r.getMessage()] == ["WARNING"]
    now[0] = LEARN_RETRY_S
    assert known.due()


def test_the_base_model_s_names_are_those_get_models_lists_without_a_parent():
    fake = FakeVLLM("d", free_port()).start()  # lists "fake", and adapter "sql" whose parent it is
    try:
        async def learn(known: ModelCards) -> None:
            async with httpx2.AsyncClient() as client:
                await known.learn(client, [f"http://127.0.0.1:{free_port()}", fake.url], {}, httpx2.Timeout(5.0))

        known = ModelCards(clock=lambda: 0.0)
        asyncio.run(learn(known))
        assert known.base == frozenset({"fake"}) and not known.due()  # the dead instance asked first, then the next
        assert known.scope_of({"model": "sql", "prompt": "hi"}) == scope("sql", None)
    finally:
        fake.stop()


def stored(hashes: list[int], lora: str | None = None, keys: list | None = None, lora_id: int | None = None,
           parent: int | None = None) -> BlockStored:
    """A BlockStored as vLLM publishes it (its extra keys untagged: router/vllm/cache_scope.py)."""
    event = VBlockStored(hashes, parent, list(range(BLOCK * len(hashes))), BLOCK, lora_id, "GPU", lora, keys)
    got = decode_batch(msgspec.msgpack.encode(VBatch(1.0, [event]))).events[0]
    assert isinstance(got, BlockStored)
    return got


def test_a_stored_event_s_scope_is_its_adapter_and_salt_and_blocks_with_media_are_not_named():
    assert stored_scope(stored([1, 2])) == (ROOT, 2)
    assert stored_scope(stored([1, 2], "sql", [["sql"], ["sql"]], lora_id=1)) == (scope("sql", None), 2)
    assert stored_scope(stored([1, 2], "sql", [["sql", "tenant-a"], ["sql"]], lora_id=1)) == (scope("sql", "tenant-a"),
                                                                                               2)
    assert stored_scope(stored([1, 2], None, [["tenant-a"], None])) == (scope(None, "tenant-a"), 2)
    assert stored_scope(stored([1, 2, 3], None, [None, [["img-hash", 0]], None])) == (ROOT, 1)  # media in block 2
    assert stored_scope(stored([1, 2], None, [[b"embeds-digest"], None])) == (ROOT, 0)
    assert stored_scope(stored([1], None, None, lora_id=3)) is None  # an adapter named by its id alone


def scheduler() -> Scheduler:
    prefill, decode = InstancePool(NodeRole.PREFILL, []), InstancePool(NodeRole.DECODE, [D1, D2])
    for url in (D1, D2):
        decode.measured(url, ServerLoad(0, 0.0, BLOCK))
    return Scheduler(RoutingPolicy.PREFIX, 0, 120.0, prefill, decode)


def held(s: Scheduler, prompt: list[int], at: str, in_scope: bytes) -> int:
    placed = s.place(prompt, avoid=frozenset({D1, D2} - {at}), scope=in_scope)
    assert placed is not None and placed.decode == at
    return placed.held


def test_a_prompt_sent_under_one_adapter_is_not_held_under_another():
    s = scheduler()
    prompt, sql, poet = list(range(12)), scope("sql", None), scope("poet", None)
    s.sent(NodeRole.DECODE, D1, prompt, sql)
    s.answered(D1, prompt, 5, sql)  # the KV of all but the last of them written
    assert held(s, prompt, D1, sql) == 12
    assert held(s, prompt, D1, poet) == held(s, prompt, D1, ROOT) == 0  # vLLM would compute it all again
    assert held(s, [*prompt, 50, 51, 52, 53], D1, sql) == 16  # the answer's 4 written: one more block


def test_kv_events_of_an_adapter_s_blocks_are_held_in_its_scope_alone():
    s = scheduler()
    prompt, sql = list(range(8)), scope("sql", None)
    s.kv_events(D2, [stored([21, 22], "sql", [["sql"], ["sql"]], lora_id=1)])
    assert held(s, prompt, D2, sql) == 8
    assert held(s, prompt, D2, ROOT) == 0
    s.kv_events(D2, [stored([23], parent=22, lora="sql", keys=[["sql"]], lora_id=1)])  # chained on its block 22
    assert held(s, [*range(8), *range(4)], D2, sql) == 12
    s.kv_events(D2, [stored([31, 32], None, [None, [["img", 0]]])])  # the base model, an image in block 2
    assert held(s, prompt, D2, ROOT) == 4
