"""The batch a model runner computes in one forward."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SequenceInput:
    """One request's part of a batch.

    Attributes:
        request_id: the request.
        token_ids: tokens computed in this forward (the whole prompt for a prompt step).
        start_pos: position of token_ids[0] in the sequence.
        block_ids: the request's whole block table.
        consumer_endpoint: producer side: the work endpoint of the node whose consumer waits
            for this prompt's KV, told its location directly (`KVReady`); "" for none.
        prompt_ids: a prompt step started on a cached prefix (`start_pos` > 0): the whole prompt, whose KV
            (cached and computed) a producer publishes, or whose tail's KV a consumer pulls; None when
            `token_ids` are all of it.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    consumer_endpoint: str = ""
    prompt_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    def whole_prompt(self) -> list[int]:
        """The prompt whose KV a producer publishes: `token_ids`, or `prompt_ids` for a tail of a cached prefix.
        Raises: ValueError for a tail without its whole prompt."""
        if self.start_pos == 0:
            return self.token_ids
        if self.prompt_ids is None or len(self.prompt_ids) != self.end_pos:
            raise ValueError(f"request {self.request_id}: tokens from {self.start_pos} on, without the whole prompt")
        return self.prompt_ids


@dataclass(frozen=True)
class ModelInput:
    """A batch: sequences whose tokens are concatenated along the token dimension."""

    sequences: list[SequenceInput] = field(default_factory=list)
    is_prompt: bool = True

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.sequences]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    def token_slices(self) -> list[slice]:
        """Where each sequence's rows sit in the batch's `[num_tokens, ...]` tensors."""
        out, start = [], 0
        for s in self.sequences:
            out.append(slice(start, start + s.num_tokens))
            start += s.num_tokens
        return out

    def select(self, request_ids: set[str]) -> ModelInput:
        return ModelInput([s for s in self.sequences if s.request_id in request_ids], self.is_prompt)
