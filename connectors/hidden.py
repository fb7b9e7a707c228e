"""Hidden states (a tensor or IntermediateTensors) split per request, described, and rejoined."""

from __future__ import annotations

import torch

from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wire import DType, TensorDesc
from kvwire.engine.kv_cache import TORCH_DTYPES

HIDDEN_KEY = "hidden_states"  # the name a plain hidden-states tensor travels under
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def split_request(hidden: torch.Tensor | IntermediateTensors,
                  rows: slice) -> tuple[list[TensorDesc], list[torch.Tensor], bool]:
    """One request's rows of the batch's hidden states, as contiguous tensors.

    Returns:
        (descriptors, tensors, is_intermediate).
    """
    if isinstance(hidden, IntermediateTensors):
        named = [(k, v[rows]) for k, v in hidden.items()]
        intermediate = True
    else:
        named = [(HIDDEN_KEY, hidden[rows])]
        intermediate = False
    tensors = [t.contiguous() for _, t in named]
    descs = [TensorDesc(name, dtype_of(t), tuple(t.shape)) for (name, _), t in zip(named, tensors)]
    return descs, tensors, intermediate


def dtype_of(t: torch.Tensor | torch.dtype) -> DType:
    """The wire name of a tensor's (or a torch) dtype."""
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot travel; supported: {sorted(map(str, _DTYPE_NAMES))}")
    return _DTYPE_NAMES[dtype]


def empty_like_descs(descs: list[TensorDesc], device: torch.device | str) -> list[torch.Tensor]:
    return [torch.empty(d.shape, dtype=TORCH_DTYPES[d.dtype], device=device) for d in descs]


def join_requests(
    parts: list[list[torch.Tensor]], descs: list[TensorDesc], intermediate: bool
) -> torch.Tensor | IntermediateTensors:
    """Concatenate per-request tensors (same descriptors' names) along the token dim."""
    joined = {d.name: torch.cat([p[i] for p in parts], dim=0) for i, d in enumerate(descs)}
    if intermediate:
        return IntermediateTensors(joined)
    return joined[HIDDEN_KEY]
