"""A request's prompt as token ids, which the prefix index is keyed by: as vLLM itself makes them, by its
POST /tokenize (the chat template, special tokens and tools of the client's body applied exactly as the
instance that answers will apply them). A Responses or Messages body that is not texts alone (tools, content
blocks, tool calls and results: a coding agent's) is rendered by the instance's POST /v1/responses/render or
/v1/messages/render, which vLLM serves with --enable-scale-out; an instance without them places such bodies by
load alone (each counted, the fix said once)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2

from kvwire.observability.metrics import Metrics
from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.upstream import PEER_ERRORS

log = logging.getLogger(__name__)
# the fields of a chat body that change its prompt's tokens (vLLM's TokenizeChatRequest)
_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


@dataclass(frozen=True)
class Ask:
    """What to ask an instance for a prompt's token ids: POST `path` with `body`; they are the answer's `key`."""

    path: str
    body: dict[str, Any]
    key: str = "tokens"

    @property
    def renders(self) -> bool:
        """Asked of a render endpoint (vLLM serves them with --enable-scale-out)."""
        return self.key == "token_ids"


def tokenize_body(endpoint: Endpoint, body: dict[str, Any]) -> Ask | list[int] | None:
    """Returns: what to ask for the prompt of the client's `body`; its token ids when it gave them; None for what
    has no single prompt (a batch of prompts, no prompt) or whose prompt the router cannot tell (an earlier
    stored turn's: `previous_response_id`)."""
    if endpoint == Endpoint.CHAT:
        if not isinstance(body.get("messages"), list):
            return None
        return Ask("/tokenize", {k: body[k] for k in _CHAT_FIELDS if k in body})
    if endpoint in (Endpoint.RESPONSES, Endpoint.MESSAGES):
        if body.get("previous_response_id"):
            return None
        messages = _as_chat(endpoint, body)
        if messages is None:
            return Ask(f"{endpoint.value}/render", body, "token_ids")
        return Ask("/tokenize", {"model": body.get("model"), "messages": messages})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if not isinstance(prompt, str):
        return None
    out: dict[str, Any] = {"model": body.get("model"), "prompt": prompt}
    return Ask("/tokenize", out | ({"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body
                                   else {}))


def _as_chat(endpoint: Endpoint, body: dict[str, Any]) -> list[dict[str, str]] | None:
    """The chat messages vLLM renders a Responses or Messages body's prompt from, for the plain bodies whose rendering
    is the same: texts only, no tools. None for the rest: rendered by the instance.

    Responses: `instructions` as the system message, then `input` (a text: one user message; or messages of text
    content). Messages: `system` as the system message, then the messages of text content, none of them a system
    message (vLLM may merge those into the first)."""
    if body.get("tools"):
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

    def __init__(self, rid: str, url: str, reason: str, no_render: bool = False):
        super().__init__(f"request {rid}: vLLM instance {url} did not tokenize its prompt: {reason}")
        self.url = url
        self.no_render = no_render  # the instance serves no render endpoints


_NO_RENDER = (403, 404, 405, 501)  # without --enable-scale-out: 403; an older vLLM: 404 or 405
RENDER_RETRY_S = 60.0  # an instance without render endpoints is asked again after this long (it may restart)


async def prompt_tokens(client: httpx2.AsyncClient, rid: str, url: str, endpoint: Endpoint, body: dict[str, Any],
                        headers: dict[str, str]) -> list[int] | None:
    """The token ids of the prompt of `body`, by the instance at `url` (`tokenize_body`'s ask). Returns: None when it
    has no single prompt, or the router cannot tell it. Raises: TokenizeFailed."""
    ask = tokenize_body(endpoint, body)
    if ask is None or isinstance(ask, list):
        return ask
    try:
        resp = await client.post(f"{url}{ask.path}", json=ask.body, headers=headers)
    except PEER_ERRORS as exc:
        raise TokenizeFailed(rid, url, type(exc).__name__) from None
    if ask.renders and resp.status_code in _NO_RENDER:
        raise TokenizeFailed(rid, url, f"{ask.path} answered {resp.status_code}: a {endpoint.value} body with tools "
                             "or content blocks is rendered by vLLM's render endpoints (vllm serve "
                             "--enable-scale-out)", no_render=True)
    if resp.status_code != 200:
        raise TokenizeFailed(rid, url, f"{ask.path} answered {resp.status_code}")
    try:
        tokens = json.loads(resp.content).get(ask.key)
    except (ValueError, AttributeError):
        tokens = None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise TokenizeFailed(rid, url, "no token ids in its answer")
    return tokens


class PromptReader:
    """Reads prompts' token ids of the decode instances up in turn; one that does not tokenize a prompt is counted
    (kvwire_vllm_tokenize_failures_total) and said once per instance, and the prompt is then placed by load alone.
    An instance without render endpoints is not asked to render for RENDER_RETRY_S (each such prompt counted)."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic):
        self._metrics = metrics
        self._clock = clock
        self._turn = 0
        self._untokenized: set[str] = set()  # instances whose /tokenize failed (warned about once)
        self._no_render: dict[str, float] = {}  # instance -> when its render endpoints are asked again

    async def read(self, client: httpx2.AsyncClient, rid: str, up: Sequence[str], endpoint: Endpoint,
                   body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        """The token ids of the prompt of `body`, by the next of `up`; None when it has none or was not tokenized."""
        self._turn += 1
        url = up[self._turn % len(up)]
        try:
            if self._no_render.get(url, 0.0) > self._clock() and _renders(endpoint, body):
                raise TokenizeFailed(rid, url, "it serves no render endpoints (vllm serve --enable-scale-out)")
            return await prompt_tokens(client, rid, url, endpoint, body, headers)
        except TokenizeFailed as exc:  # placed by load alone, the path decided as if it held nothing
            if exc.no_render:
                self._no_render[url] = self._clock() + RENDER_RETRY_S
            self._metrics.vllm_tokenize_failures.inc()
            level = logging.DEBUG if exc.url in self._untokenized else logging.WARNING
            self._untokenized.add(exc.url)
            log.log(level, "%s; placed by load alone (kvwire_vllm_tokenize_failures_total)", exc)
            return None


def _renders(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    ask = tokenize_body(endpoint, body)
    return isinstance(ask, Ask) and ask.renders


def completion_tokens_of(response: bytes) -> int:
    """The tokens a decode instance's whole JSON answer generated: a completion's or chat's for its one choice
    (usage.completion_tokens), a Response's or Message's (usage.output_tokens); 0 when it is not known (no usage,
    or several choices: which of them a next prompt continues is not)."""
    try:
        answer = json.loads(response)
        if "choices" in answer:
            tokens = answer["usage"]["completion_tokens"] if len(answer["choices"]) == 1 else 0
        else:
            tokens = answer["usage"]["output_tokens"]
    except (ValueError, KeyError, TypeError):
        return 0
    return tokens if isinstance(tokens, int) and tokens > 0 else 0
