"""Hidden states (a tensor or IntermediateTensors) split per request, described, and rejoined."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from kvwire.connectors.kv_pool import TORCH_DTYPES
from kvwire.connectors.types import IntermediateTensors
from kvwire.connectors.wire import DType, KVLocation, TensorDesc

HIDDEN_KEY = "hidden_states"  # the name a plain hidden-states tensor travels under
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def split_request(hidden: torch.Tensor | IntermediateTensors,
                  rows: slice) -> tuple[list[TensorDesc], list[torch.Tensor], bool]:
    """What travels of one request's rows (`rows`) of the batch's hidden states, as contiguous tensors: a last
    pipeline stage's hidden states, the prompt's last row alone (`[1, hidden]`: the first token is sampled from
    it, and nothing reads the others); a pipeline stage's intermediate tensors, every row (the next stage's
    forward reads them all).

    Returns:
        (descriptors, tensors, is_intermediate).
    """
    if isinstance(hidden, IntermediateTensors):
        named = [(k, v[rows]) for k, v in hidden.items()]
        intermediate = True
    else:
        named = [(HIDDEN_KEY, hidden[rows][-1:])]
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


def desc_nbytes(desc: TensorDesc) -> int:
    return math.prod(desc.shape) * TORCH_DTYPES[desc.dtype].itemsize


def empty_like_descs(descs: list[TensorDesc], device: torch.device | str) -> list[torch.Tensor]:
    return [torch.empty(d.shape, dtype=TORCH_DTYPES[d.dtype], device=device) for d in descs]


def tensors_from_bytes(descs: list[TensorDesc], data: bytes, device: torch.device | str) -> list[torch.Tensor]:
    """Tensors of `descs` holding `data` (their bytes back to back), on `device`.

    Raises:
        ValueError: data is not exactly their size.
    """
    sizes = [desc_nbytes(d) for d in descs]
    if len(data) != sum(sizes):
        raise ValueError(f"{len(data)} bytes of hidden states; expected {sum(sizes)}")
    buf, out, offset = bytearray(data), [], 0  # writable: torch warns of read-only buffers
    on_host = torch.device(device).type == "cpu"
    for d, n in zip(descs, sizes):
        dtype = TORCH_DTYPES[d.dtype]
        t = torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize, offset=offset) if n else \
            torch.empty(0, dtype=dtype)
        out.append(t.view(d.shape) if on_host else t.view(d.shape).to(device))
        offset += n
    return out


def join_requests(
    parts: list[list[torch.Tensor]], descs: list[TensorDesc], intermediate: bool, lengths: Sequence[int]
) -> torch.Tensor | IntermediateTensors:
    """The batch's hidden states from per-request tensors (same descriptors' names), requests of `lengths` tokens
    back to back along the token dim. A request's part of one row (a last stage's: `split_request`) is its last
    row; its other rows are left unwritten (nothing reads them)."""
    if len(parts) == 1 and not intermediate and len(parts[0]) == 1 and parts[0][0].shape[0] == lengths[0]:
        return parts[0][0]  # one request, every row: nothing to join
    if intermediate or all(p[0].shape[0] == n for p, n in zip(parts, lengths)):
        joined = {d.name: torch.cat([p[i] for p in parts], dim=0) for i, d in enumerate(descs)}
        return IntermediateTensors(joined) if intermediate else joined[HIDDEN_KEY]
    first = parts[0][0]
    out = torch.empty((sum(lengths), *first.shape[1:]), dtype=first.dtype, device=first.device)  # [tokens, hidden]
    end = 0
    for part, n in zip(parts, lengths):
        end += n
        rows = part[0]  # [1 or n, hidden]
        out[end - rows.shape[0]:end] = rows
    return out


INLINE_MAX = 64 << 10  # hidden states up to this size travel inline (KVReady; shm reply packet), not a memfd


def host_bytes(tensors: list[torch.Tensor]) -> memoryview:
    """`tensors`' bytes back to back, as one buffer (a copy only when there are several, or off the host)."""
    flat = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors]
    joined = flat[0] if len(flat) == 1 else torch.cat(flat)
    return memoryview(joined.numpy().data).cast("B")  # .data: numpy types its buffer so for Python 3.11


def fill_tensors(tensors: list[torch.Tensor], data: memoryview) -> int:
    """Copy `data` into `tensors` (contiguous, any device), back to back. Returns the bytes copied.

    Raises:
        ValueError: data is not exactly their size.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    if len(data) != total:
        raise ValueError(f"hidden states of {len(data)} bytes; expected {total}")
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst = t.reshape(-1).view(torch.uint8)  # [n]
        host = dst if dst.device.type == "cpu" else torch.empty(n, dtype=torch.uint8)
        host.numpy().data[:] = data[offset:offset + n]  # a plain memcpy: `data` may be read-only (a peer's memory)
        if host is not dst:
            dst.copy_(host)
        offset += n
    return total


def kv_ready_location(loc: KVLocation, hidden: Sequence[torch.Tensor]) -> KVLocation:
    """What the producer tells its consumer directly: `loc`, plus the hidden states' bytes when the location
    has a shared-memory hold word and they are small (the consumer then reads with no round trip)."""
    nbytes = sum(t.numel() * t.element_size() for t in hidden)
    if loc.shm_hold is None or not hidden or nbytes > INLINE_MAX:
        return loc
    return msgspec.structs.replace(loc, inline_hidden=bytes(host_bytes(list(hidden))))
