"""POST /tokenize and /detokenize, as vLLM serves them: the served model's token ids for a text (or a chat,
rendered with its template) and back. Benchmark clients use them to size their prompts."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec

from kvwire.router.schemas import APIError, ChatMessage, ChatRequest, parse_body

if TYPE_CHECKING:
    from kvwire.router.app import Router


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # instead of prompt: a chat, rendered with the template
    add_special_tokens: bool = True  # a chat's rendered text holds its specials: none are added to it
    add_generation_prompt: bool = True
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


async def tokenize(router: Router, body: bytes) -> dict:
    """The `Router` (router/app.py) tokenizes one request's text. Raises APIError(400)."""
    req = parse_body(body, TokenizeRequest, router.config.lenient)
    router.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if req.messages is not None:
        chat = ChatRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                           chat_template=req.chat_template)
        text = await asyncio.to_thread(router.chat_template.render, chat)
        ids = router.tokenizer.encode(text, add_special_tokens=False)
    else:
        assert req.prompt is not None
        ids = router.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [router.tokenizer.decode([i]) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": router.max_len, "tokens": ids, "token_strs": strs}


def detokenize(router: Router, body: bytes) -> dict:
    """Raises APIError(400) for ids outside the vocabulary."""
    req = parse_body(body, DetokenizeRequest, router.config.lenient)
    router.check_model(req.model)
    vocab = router.model_config.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": router.tokenizer.decode(req.tokens)}
