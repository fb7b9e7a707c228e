"""Data types of the connector contract, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


class IntermediateTensors:
    """Named tensors that stand for a pipeline stage's output (hidden states, residual).

    Indexing with a string returns one tensor; with a slice, a new instance whose
    every tensor is sliced along dim 0 (the token dimension).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], kv_connector_output: object | None = None):
        self.tensors = dict(tensors)
        self.kv_connector_output = kv_connector_output

    def __getitem__(self, key: str | slice) -> torch.Tensor | IntermediateTensors:
        if isinstance(key, str):
            return self.tensors[key]
        if isinstance(key, slice):
            return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})
        raise TypeError(f"IntermediateTensors index must be str or slice, got {type(key).__name__}")

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def items(self):
        return self.tensors.items()

    def keys(self):
        return self.tensors.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntermediateTensors):
            return NotImplemented
        if self.tensors.keys() != other.tensors.keys():
            return False
        return all(
            self.tensors[k].shape == other.tensors[k].shape
            and self.tensors[k].dtype == other.tensors[k].dtype
            and torch.equal(self.tensors[k], other.tensors[k])
            for k in self.tensors
        )

    # No __hash__: a class that defines __eq__ gets __hash__ = None, and a mutable container must
    # not be hashable.

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        return f"IntermediateTensors({{{inner}}})"


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and durations of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float = 0.0
    model_forward_time: float = 0.0
    model_execute_time: float = 0.0

    def mark_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
            self.time_in_queue = now - self.arrival_time

    def mark_first_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class ModelRunnerOutput:
    """What one engine step produced: one sampled token per scheduled request."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_tokens(cls, req_ids: list[str], tokens: list[int]) -> ModelRunnerOutput:
        return cls(
            req_ids=list(req_ids),
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[t] for t in tokens],
        )
