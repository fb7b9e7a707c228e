"""Answer bodies in OpenAI's shapes: completions and chat completions, whole or as stream chunks.

Logprobs are shown as each API does: completions as `tokens / token_logprobs / top_logprobs /
text_offset`, chat as `content: [{token, logprob, bytes, top_logprobs}]`. A token is named by its
text, or "token_id:N" when the request says return_tokens_as_token_ids.
"""

from __future__ import annotations

import enum
import time

from kvwire.engine.tokenizer import Tokenizer
from kvwire.protocol.work import TokenLogprobs
from kvwire.router.choice import Choice
from kvwire.router.sampling import Plan


class Api(enum.StrEnum):
    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"
    RESPONSES = "response"  # OpenAI's Responses API: shaped by router/responses_api.py
    MESSAGES = "message"  # Anthropic's Messages API: shaped by router/messages_api.py


class Shaper:
    """Builds one request's bodies."""

    def __init__(self, api: Api, request_id: str, model: str, plan: Plan, tokenizer: Tokenizer):
        self.api = api
        self.request_id = request_id
        self.model = model
        self.plan = plan
        self._tokenizer = tokenizer
        self.created = int(time.time())

    def whole(self, choices: list[Choice], usage: dict, kvwire: dict) -> dict:
        """The non-streamed answer."""
        shaped = [self._choice(c, c.text, range(len(c.token_ids)), final=True) for c in choices]
        return {**self._head(self.api.value), "choices": shaped, "usage": usage, "kvwire": kvwire}

    def chunk(self, choice: Choice, first: bool) -> dict | None:
        """A stream chunk with what `choice` added since its last one; None when it added nothing to show."""
        text, tokens = choice.stream_delta()
        if not text and not first and not choice.finished and not (tokens and self.plan.logprobs is not None):
            return None
        if first and choice.echo_text and self.api == Api.COMPLETIONS:
            text = choice.echo_text + text
        shaped = self._choice(choice, text, tokens, final=choice.finished, first=first)
        return {**self._head(self.api.value + ".chunk" if self.api == Api.CHAT else self.api.value),
                "choices": [shaped]}

    def usage_chunk(self, usage: dict, kvwire: dict) -> dict:
        """stream_options.include_usage's last chunk: no choices, the usage (kvwire's transfer report rides along)."""
        obj = self.api.value + ".chunk" if self.api == Api.CHAT else self.api.value
        return {**self._head(obj), "choices": [], "usage": usage, "kvwire": kvwire}

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, c: Choice, text: str, tokens, final: bool, first: bool = False) -> dict:
        finish = c.finish_reason if final else None
        out: dict = {"index": c.index}
        if self.api == Api.COMPLETIONS:
            full = c.echo_text + text if not self.plan.stream and c.echo_text else text
            out.update(text=full, logprobs=self._completion_logprobs(c, tokens), finish_reason=finish)
        elif self.plan.stream:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            out.update(delta=delta, logprobs=self._chat_logprobs(c, tokens), finish_reason=finish)
        else:
            out.update(message={"role": "assistant", "content": text}, logprobs=self._chat_logprobs(c, tokens),
                       finish_reason=finish)
        out["stop_reason"] = c.stop_reason if final else None
        if self.plan.return_token_ids:
            out["token_ids"] = [c.token_ids[i] for i in tokens] if self.plan.stream else list(c.token_ids)
            if not self.plan.stream:
                out["prompt_token_ids"] = list(c.prompt_ids)
        return out

    def _name(self, token: int) -> str:
        return f"token_id:{token}" if self.plan.token_ids_as_text else self._tokenizer.decode([token])

    def _completion_logprobs(self, c: Choice, tokens) -> dict | None:
        if self.plan.logprobs is None:
            return None
        picked = list(tokens)
        shift = len(c.echo_text)
        return {"tokens": [self._name(c.token_ids[i]) for i in picked],
                "token_logprobs": [c.logprobs[i].logprob for i in picked],
                "top_logprobs": [self._top_dict(c.token_ids[i], c.logprobs[i]) for i in picked],
                "text_offset": [c.offsets[i] + shift for i in picked]}

    def _top_dict(self, token: int, lp: TokenLogprobs) -> dict[str, float]:
        """The sampled token first, then the top ones: up to logprobs + 1 entries (OpenAI's and vLLM's)."""
        out: dict[str, float] = {self._name(token): lp.logprob}
        for token, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
            out.setdefault(self._name(token), value)
        return out

    def _chat_logprobs(self, c: Choice, tokens) -> dict | None:
        if self.plan.logprobs is None:
            return None
        return {"content": [self._chat_entry(c.token_ids[i], c.logprobs[i]) for i in tokens]}

    def _chat_entry(self, token: int, lp: TokenLogprobs) -> dict:
        top = [self._named(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        return {**self._named(token, lp.logprob), "top_logprobs": top}

    def _named(self, token: int, logprob: float) -> dict:
        name = self._name(token)
        return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}
