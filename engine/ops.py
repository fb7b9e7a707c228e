"""Batch-invariant row-wise kernels.

Disaggregated outputs are compared token for token with single-process runs whose
batches differ, so a sequence's rows must come out bit-identical whichever other
rows share the batch. CPU GEMMs are not: `F.linear` picks a different blocking (and
so a different summation order) for 1 row than for many. Running every row-wise op
on fixed chunks of exactly `ROW_CHUNK` rows (the last one zero-padded) makes the
kernel see the same shape every time, so each row's bits depend on that row alone.
Attention is computed per sequence elsewhere and needs none of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_CHUNK = 16


def map_row_chunks(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise fn on fixed chunks of `ROW_CHUNK` rows.

    Args:
        fn: maps tensors of `[ROW_CHUNK, ...]` rows to `[ROW_CHUNK, ...]`; row i of the
            output must depend only on row i of the inputs.
        xs: inputs with the same number of rows `[M, ...]`.
    Returns:
        fn applied to all rows, `[M, ...]`.
    """
    m = xs[0].shape[0]
    if m == 0:
        return fn(*(x[:0] for x in xs))
    pad = -m % ROW_CHUNK
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) for x in xs)
    chunks = [fn(*parts) for parts in zip(*(x.split(ROW_CHUNK) for x in xs))]
    return torch.cat(chunks)[:m]


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`, bit-identical per row whatever M is.

    Args:
        x: `[M, in]`.
        weight: `[out, in]`.
        bias: `[out]`, or None.
    Returns:
        `[M, out]`.
    """
    return map_row_chunks(lambda c: F.linear(c, weight, bias), x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm (variance in float32, like transformers), batch-invariant.

    Args:
        x: `[M, hidden]`.
        weight: `[hidden]`.
        eps: added to the mean square.
    Returns:
        `[M, hidden]` in x's dtype.
    """

    def norm(c: torch.Tensor) -> torch.Tensor:
        c32 = c.float()
        c32 = c32 * torch.rsqrt(c32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * c32.to(c.dtype)

    return map_row_chunks(norm, x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, chunked so vector/scalar kernel tails land the same way.

    Args:
        gate: `[M, intermediate]`.
        up: `[M, intermediate]`.
    Returns:
        `[M, intermediate]`.
    """
    return map_row_chunks(lambda g, u: F.silu(g) * u, gate, up)
