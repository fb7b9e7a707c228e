"""Data types of the connector contract, shaped like vLLM's (the engine's own step outputs: engine/outputs.py)."""

from __future__ import annotations

from collections.abc import Iterator

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
