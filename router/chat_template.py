"""Chat messages -> prompt text, with the checkpoint's own Jinja chat template, rendered as transformers does.

The template comes from the request's `chat_template` (as vLLM accepts), else the checkpoint's
tokenizer_config.json `chat_template` (a string, or a list of named ones: "default"), else its
chat_template.jinja. It runs in Jinja's immutable sandbox with transformers' helpers
(`raise_exception`, `tojson`, `strftime_now`, loop controls, trim_blocks and lstrip_blocks), and
gets the checkpoint's special tokens (`bos_token`, `eos_token`, ...) by name.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from kvwire.router.schemas import APIError, ChatMessage, ChatRequest

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
ROLES = ("system", "user", "assistant")


class ChatTemplate:
    """The checkpoint's template (if any) and special tokens; renders requests' messages."""

    def __init__(self, model_dir: Path):
        config = _read_json(model_dir / "tokenizer_config.json")
        self.source = _configured_template(config.get("chat_template"))
        jinja_file = model_dir / "chat_template.jinja"
        if self.source is None and jinja_file.is_file():
            self.source = jinja_file.read_text()
        self.specials = {name: _token_text(config.get(name)) for name in _SPECIALS}

    def render(self, req: ChatRequest) -> str:
        """The prompt text for req's messages. Raises APIError(400): no template, a bad message or template."""
        source = req.chat_template or self.source
        if source is None:
            raise APIError(400, "the model's checkpoint has no chat template (tokenizer_config.json chat_template "
                                "or chat_template.jinja); send one as chat_template", param="chat_template")
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")
        messages = [_plain(m, i) for i, m in enumerate(req.messages)]
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise APIError(400, "continue_final_message needs a final assistant message", param="messages")
        kwargs = {**self.specials, **(req.chat_template_kwargs or {})}
        try:
            text = _compile(source).render(messages=messages, add_generation_prompt=req.add_generation_prompt,
                                           tools=None, documents=None, **kwargs)
        except jinja2.TemplateError as exc:
            raise APIError(400, f"the chat template failed: {exc}", param="chat_template") from None
        if req.continue_final_message:
            text = _cut_after_final(text, messages[-1]["content"])
        return text


def _plain(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as templates expect it: role and content text (text parts joined by newlines, as vLLM does)."""
    if message.role not in ROLES:
        raise APIError(400, f"messages[{index}].role {message.role!r} is not one of {', '.join(ROLES)}",
                       param="messages")
    if message.tool_calls or message.tool_call_id or message.function_call or message.audio:
        raise APIError(400, f"messages[{index}]: tool calls and audio are not supported", param="messages")
    content = message.content
    if isinstance(content, list):
        other = [p.type for p in content if p.type != "text" or p.text is None]
        if other:
            raise APIError(400, f"messages[{index}]: only text content parts are served, not {other[0]!r}",
                           param="messages")
        content = "\n".join(p.text or "" for p in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _cut_after_final(text: str, final: str) -> str:
    """transformers' continue_final_message: the rendered text ends where the final message's content does."""
    needle = final.strip() if final.strip() in text else final
    at = text.rfind(needle)
    if not needle or at < 0:
        raise APIError(400, "continue_final_message: the template does not render the final message's content "
                            "verbatim", param="continue_final_message")
    return text[:at + len(needle)]


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the chat template does not compile: {exc}", param="chat_template") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _configured_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
