"""A request's prompt as token ids, which the prefix index is keyed by: as vLLM itself makes them, by its
POST /tokenize (the chat template, special tokens and tools of the client's body applied exactly as the
instance that answers will apply them)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import httpx2

from kvwire.observability.metrics import Metrics
from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.upstream import PEER_ERRORS

log = logging.getLogger(__name__)
# the fields of a chat body that change its prompt's tokens (vLLM's TokenizeChatRequest)
_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


def tokenize_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """Returns: the /tokenize body for the prompt of the client's `body`; its token ids when it gave them; None for
    what has no single prompt (a batch of prompts, no prompt) or whose prompt the router cannot tell (below)."""
    if endpoint == Endpoint.CHAT:
        return {k: body[k] for k in _CHAT_FIELDS if k in body} if isinstance(body.get("messages"), list) else None
    if endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES):
        messages = _as_chat(endpoint, body)
        return None if messages is None else {"model": body.get("model"), "messages": messages}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if not isinstance(prompt, str):
        return None
    out: dict[str, Any] = {"model": body.get("model"), "prompt": prompt}
    return out | ({"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {})


def _as_chat(endpoint: Endpoint, body: dict[str, Any]) -> list[dict[str, str]] | None:
    """The chat messages vLLM renders a Responses or Messages body's prompt from, for the plain bodies whose rendering
    is the same: texts only, no tools, no earlier stored turn (its KV is where that turn was answered). None for
    the rest: placed by load alone, as a prompt the router knows nothing of.

    Responses: `instructions` as the system message, then `input` (a text: one user message; or messages of text
    content). Messages: `system` as the system message, then the messages of text content, none of them a system
    message (vLLM may merge those into the first)."""
    if body.get("tools") or body.get("previous_response_id"):
        return None
    system, turns = (("instructions", "input") if endpoint == Endpoint.RESPONSES else ("system", "messages"))
    lead = body.get(system)
    if lead is not None and not isinstance(lead, str):
        return None
    given = body.get(turns)
    if endpoint == Endpoint.RESPONSES and isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list):
        return None
    texts = [_text_turn(turn) for turn in given]
    if not all(texts):
        return None
    return ([{"role": "system", "content": lead}] if lead else []) + texts  # type: ignore[operator]


_TURN_KEYS = frozenset({"role", "content", "type"})


def _text_turn(turn: object) -> dict[str, str] | None:
    """A user's or the assistant's message of a text alone, as chat's; None for anything else."""
    if not isinstance(turn, dict) or set(turn) - _TURN_KEYS or turn.get("type", "message") != "message":
        return None
    role, content = turn.get("role"), turn.get("content")
    return {"role": role, "content": content} if role in ("user", "assistant") and isinstance(content, str) else None


class TokenizeFailed(Exception):
    """An instance did not tokenize a prompt (its answer to the request itself says why, if the body is wrong)."""

    def __init__(self, rid: str, url: str, reason: str):
        super().__init__(f"request {rid}: vLLM instance {url} did not tokenize its prompt: {reason}")
        self.url = url


async def prompt_tokens(client: httpx2.AsyncClient, rid: str, url: str, endpoint: Endpoint, body: dict[str, Any],
                        headers: dict[str, str]) -> list[int] | None:
    """The token ids of the prompt of `body`, by POST {url}/tokenize. Returns: None when it has no single prompt.
    Raises: TokenizeFailed."""
    ask = tokenize_body(endpoint, body)
    if ask is None or isinstance(ask, list):
        return ask
    try:
        resp = await client.post(f"{url}/tokenize", json=ask, headers=headers)
    except PEER_ERRORS as exc:
        raise TokenizeFailed(rid, url, type(exc).__name__) from None
    if resp.status_code != 200:
        raise TokenizeFailed(rid, url, f"answered {resp.status_code}")
    try:
        tokens = json.loads(resp.content).get("tokens")
    except (ValueError, AttributeError):
        tokens = None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise TokenizeFailed(rid, url, "no token ids in its answer")
    return tokens


class PromptReader:
    """Reads prompts' token ids of the decode instances up in turn; one that does not tokenize a prompt is counted
    (kvwire_vllm_tokenize_failures_total) and said once per instance, and the prompt is then placed by load alone."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._turn = 0
        self._untokenized: set[str] = set()  # instances whose /tokenize failed (warned about once)

    async def read(self, client: httpx2.AsyncClient, rid: str, up: Sequence[str], endpoint: Endpoint,
                   body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        """The token ids of the prompt of `body`, by the next of `up`; None when it has none or was not tokenized."""
        self._turn += 1
        try:
            return await prompt_tokens(client, rid, up[self._turn % len(up)], endpoint, body, headers)
        except TokenizeFailed as exc:  # placed by load alone, the path decided as if it held nothing
            self._metrics.vllm_tokenize_failures.inc()
            level = logging.DEBUG if exc.url in self._untokenized else logging.WARNING
            self._untokenized.add(exc.url)
            log.log(level, "%s; placed by load alone (kvwire_vllm_tokenize_failures_total)", exc)
            return None


def completion_tokens_of(response: bytes) -> int:
    """The tokens a decode instance's whole JSON answer generated for its one choice (usage.completion_tokens);
    0 when it is not known (no usage, or several choices: which of them a next prompt continues is not)."""
    try:
        answer = json.loads(response)
        tokens = answer["usage"]["completion_tokens"] if len(answer["choices"]) == 1 else 0
    except (ValueError, KeyError, TypeError):
        return 0
    return tokens if isinstance(tokens, int) and tokens > 0 else 0
