"""One choice of an answer as its `TokenChunk`s arrive: its tokens, their logprobs, and its text, detokenized
incrementally and cut at the first stop string.

A stop string is looked for after every token (once min_tokens are out), so the text and the tokens end
at the token that completed it, wherever the decode node's chunks happen to split; the router then
cancels the rest on the node. While streaming, text that may be the start of a stop string, or an
incomplete UTF-8 character, is held back until it is known.
"""

from __future__ import annotations

import time

from kvwire.engine.tokenizer import Tokenizer
from kvwire.observability.labels import PathReason, ProxyPath
from kvwire.observability.tracing import SpanHandle
from kvwire.protocol.work import DecodeStats, TokenChunk, TokenLogprobs
from kvwire.router.sampling import Plan

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to, until its last byte arrives


class Choice:
    """Attributes:
    index: the choice's place in the answer (prompt index x n + choice).
    prompt_ids: its prompt; echo_text: the prompt's text when echoed, else "".
    token_ids, logprobs: what it sampled so far (logprobs empty unless asked), up to its stop.
    text: its text so far, without the echo; offsets: where each token's text starts in it.
    finish_reason, stop_reason: set once finished ("stop" for a stop string, which stop_reason names).
    """

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], plan: Plan, tokenizer: Tokenizer,
                 echo_text: str = ""):
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.echo_text = echo_text
        self._plan = plan
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.offsets: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.stats: DecodeStats | None = None
        self.span: SpanHandle | None = None  # the router's span of it (observability/tracing.py), once dispatched
        self.path: ProxyPath | None = None  # the way the router sent it, and why (set once dispatched)
        self.reason: PathReason | None = None
        self.first_token_at: float | None = None
        self.sent_chars = 0  # of text, streamed already
        self.sent_tokens = 0  # of token_ids, streamed already
        self._prefix = 0  # incremental detokenizer: token_ids[_prefix:_read] decode to the end of text
        self._read = 0
        self._longest_stop = max((len(s) for s in plan.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: TokenChunk) -> bool:
        """Take a chunk. Returns True when a stop string ended the choice in it (the node must be told)."""
        if self.first_token_at is None and chunk.token_ids:
            self.first_token_at = time.monotonic()
        for k, token in enumerate(chunk.token_ids):
            self.token_ids.append(token)
            if k < len(chunk.logprobs):
                self.logprobs.append(chunk.logprobs[k])
            self.offsets.append(len(self.text))
            self.text += self._new_text()
            if self._cut_at_stop():
                self.finish_reason = "stop"
                return True
        if chunk.finished:
            self.text += self._new_text(final=True)
            self.finish_reason = chunk.finish_reason or "stop"
            self.stats = chunk.stats
        return False

    def total_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    def stream_delta(self) -> tuple[str, list[int]]:
        """Text and token ids not streamed yet, holding back what a stop string or UTF-8 may still change."""
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        text = self.text[self.sent_chars:end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        first = self.sent_tokens
        self.sent_tokens = len(self.token_ids)
        return text, list(range(first, self.sent_tokens))

    def _new_text(self, final: bool = False) -> str:
        """vLLM's incremental detokenization: decode a short window, so a token's text is exact (spaces and
        multi-token characters included) at O(window) per token."""
        prefix = self._tokenizer.decode(self.token_ids[self._prefix:self._read])
        full = self._tokenizer.decode(self.token_ids[self._prefix:])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""  # nothing yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self.token_ids)
        return full[len(prefix):]

    def _cut_at_stop(self) -> bool:
        if not self._plan.stop or len(self.token_ids) < self._plan.sampling.min_tokens:
            return False
        start = max(0, self.offsets[-1] - self._longest_stop + 1)
        found = [(at, s) for s in self._plan.stop if (at := self.text.find(s, start)) >= 0]
        if not found:
            return False
        at, stop = min(found)
        self.text = self.text[:at + len(stop) if self._plan.include_stop else at]
        self.stop_reason = stop
        return True

    def _held_back(self) -> int:
        """Length of the text's longest suffix that begins a stop string."""
        for size in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self._plan.stop):
                return size
        return 0
