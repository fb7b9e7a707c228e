"""A request's cache scope: which of a vLLM server's prefix caches its prompt's KV blocks belong to.

vLLM names a KV block by its tokens, everything before them, and the request's extra keys (its
`generate_block_hash_extra_keys`): the LoRA adapter, the `cache_salt` (in the first block's), the media in the
block (images, audio) and prompt embeddings. The same tokens under another adapter or salt share no block: a prompt
asked of adapter `sql` is computed whole on a server whose cache holds it under adapter `poet`. So the router's
prefix index (router/prefix_index.py) starts each prompt's chain of block names at its scope:

- the base model's, no salt, no media: ROOT, where vLLM's KV events of such prompts start too;
- else a digest of the adapter (the body's `model` when it is not one of the base model's names), the salt, and
  the media parts of the body's messages as written (the same picture at another URL is another scope: that costs
  a prediction, never a wrong one).

The base model's names are what GET /v1/models lists without a `parent` (LoRA adapters have one). `ModelCards`
learns them from a decode instance; until it has, a body that names a model is scoped by that name: predicted
uncached, never wrongly cached.

KV events (router/kv_events.py): a BlockStored's `lora_name` and `extra_keys` (vLLM publishes them untagged, one
entry per block: the LoRA name, `(media id, offset)` pairs, the salt, prompt-embedding digests) give the scope of a
prompt's first block (`stored_scope`). A block whose keys hold media or embeddings, and every block after it, is
not named: kvwire has the media's place in a prompt, not vLLM's hash of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx2
import msgspec

from kvwire.engine.block_names import ROOT
from kvwire.router.kv_events import BlockStored
from kvwire.router.vllm.upstream import PEER_ERRORS

log = logging.getLogger(__name__)

# content parts of a message that are text (or a tool's call and result, whose text the tokens hold); any other
# part (an image, audio, a video, a file) enters the scope
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "message", "function_call",
                         "function_call_output", "tool_use", "tool_result", "thinking", "redacted_thinking",
                         "reasoning", "summary_text", "reasoning_text"})
_MESSAGE_FIELDS = ("messages", "input", "system", "instructions")  # chat, Responses and Messages bodies
_CONTENT_KEYS = ("content", "output")  # where a message or a tool's result holds its parts
LEARN_RETRY_S = 5.0  # how soon GET /v1/models is asked again after it gave no names


def scope(adapter: str | None, salt: str | None, media: Sequence[Any] = ()) -> bytes:
    """The root a prompt's block names chain from (module docstring): ROOT with none of them."""
    if adapter is None and salt is None and not media:
        return ROOT
    key = json.dumps([adapter, salt, list(media)], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"kvwire-scope").digest()


def media_parts(body: dict[str, Any]) -> list[Any]:
    """The non-text content parts of the body's messages, in order: only what a message's (or a tool result's)
    `content` or `output` holds, not its other fields (a chat message's `tool_calls`, a text block's
    `cache_control`), which are text to vLLM or no part of the prompt."""
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            kind = node.get("type")
            if isinstance(kind, str) and kind not in _TEXT_PARTS:
                found.append(node)
                return
            for key in _CONTENT_KEYS:
                walk(node.get(key))

    for field in _MESSAGE_FIELDS:
        walk(body.get(field))
    return found


def stored_scope(event: BlockStored) -> tuple[bytes, int] | None:
    """Returns: the scope of the prompt whose blocks `event` stored (used when it starts at the prompt's start) and
    how many of its first blocks kvwire names; None for an adapter the event does not name (an older vLLM's
    `lora_id` alone)."""
    if event.lora_id is not None and event.lora_name is None:
        return None
    salt: str | None = None
    keys = event.extra_keys or []
    for i, entry in enumerate(keys[:len(event.block_hashes)]):
        items = list(entry or ())
        if event.lora_name is not None and items and _text(items[0]) == event.lora_name:
            items = items[1:]
        texts = [_text(item) for item in items]
        if any(t is None for t in texts):  # media or a prompt-embedding digest: not named, nor what follows
            return scope(event.lora_name, salt), i
        if i == 0 and texts:
            salt = texts[0]
    return scope(event.lora_name, salt), len(event.block_hashes)


def _text(raw: msgspec.Raw) -> str | None:
    try:
        return msgspec.msgpack.decode(raw, type=str)
    except msgspec.ValidationError:
        return None


class ModelCards:
    """The base model's names, as a decode instance's GET /v1/models lists them; the scope of a client's body."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.base: frozenset[str] | None = None  # None: not learned yet
        self._clock = clock
        self._asked_at = -LEARN_RETRY_S
        self._said = False  # the WARNING that no instance told the names, once

    def scope_of(self, body: dict[str, Any]) -> bytes:
        """The cache scope of a client's body (module docstring)."""
        model, salt = body.get("model"), body.get("cache_salt")
        adapter = model if isinstance(model, str) and (self.base is None or model not in self.base) else None
        return scope(adapter, salt if isinstance(salt, str) and salt else None, media_parts(body))

    def due(self) -> bool:
        """Whether to ask for the names now: not learned, and not asked in the last LEARN_RETRY_S."""
        return self.base is None and self._clock() - self._asked_at >= LEARN_RETRY_S

    async def learn(self, client: httpx2.AsyncClient, urls: Sequence[str], headers: dict[str, str],
                    timeout: httpx2.Timeout) -> None:
        """Ask `urls` in turn for GET /v1/models (with a client's `headers`: a server with --api-key wants its key)
        until one lists the base model's names."""
        self._asked_at = self._clock()
        for url in urls:
            try:
                resp = await client.get(f"{url}/v1/models", headers=headers, timeout=timeout)
                cards = resp.json()["data"] if resp.status_code == 200 else None
                names = frozenset(c["id"] for c in cards if c.get("parent") is None) if cards else None
            except (*PEER_ERRORS, ValueError, KeyError, TypeError, AttributeError) as exc:  # not a list of cards
                log.debug("GET %s/v1/models: %s", url, exc)
                continue
            if names:
                self.base = names
                log.info("base model names (cache scope ROOT): %s", ", ".join(sorted(names)))
                return
        if urls and not self._said:
            self._said = True
            log.warning("no decode instance's GET /v1/models listed the base model's names yet (asked again in %.0f "
                        "s): until one does, a request naming a model is predicted to hold nothing of its prompt",
                        LEARN_RETRY_S)
