"""Where vLLM keeps one token's K and V in a per-layer KV view `[blocks, heads, block_size, 2 * head_dim]`, for
tests that check KV token by token: the CPU backend (its `vec` kernels) keeps a head page's K transposed,
`[head_dim, block_size]`, then its V, `[block_size, head_dim]`; GPU backends (and MLA's latent) token by token, each
token's K and V side by side."""

from __future__ import annotations

import torch


def slot(kv: torch.Tensor, block: int, head: int, token: int,
         transposed_k: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the token's K and V. `transposed_k`: the CPU backend's page; None: as the tensor's device says."""
    page, n = kv[block, head].view(-1), kv.shape[2]
    dim = page.numel() // (2 * n)
    if not (kv.device.type == "cpu" if transposed_k is None else transposed_k):
        return page.view(n, 2 * dim)[token, :dim], page.view(n, 2 * dim)[token, dim:]
    return page[:n * dim].view(dim, n)[:, token], page[n * dim:].view(n, dim)[token]


def put(kv: torch.Tensor, block: int, head: int, token: int, value: torch.Tensor,
        transposed_k: bool | None = None) -> None:
    """Write `value` ([2, head_dim]: K, then V) as the token's."""
    k, v = slot(kv, block, head, token, transposed_k)
    k[:], v[:] = value[0], value[1]


def read_kv(kv: torch.Tensor, block: int, head: int, token: int, transposed_k: bool | None = None) -> torch.Tensor:
    """The token's K and V: [2, head_dim]."""
    return torch.stack(slot(kv, block, head, token, transposed_k))
