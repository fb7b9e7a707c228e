"""The paged KV pool: allocated once per process, block-major so a block is one piece.

Layout: `data[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`. Every
layer's K and V of one block sit together, so moving a request's KV moves one piece
per block (one per run of consecutive blocks), not one per layer. The per-layer views
that the connector contract calls `kv_caches` are strided views of the same storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwire.connectors.wire import DType, KVLayout

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
    DType.UINT8: torch.uint8,
    DType.FLOAT8_E4M3FN: torch.float8_e4m3fn,
    DType.FLOAT8_E5M2: torch.float8_e5m2,
}


@dataclass(frozen=True)
class KVPool:
    layout: KVLayout
    num_blocks: int
    data: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> KVPool:
        shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        data = torch.zeros(shape, dtype=TORCH_DTYPES[layout.dtype], device=device)
        return cls(layout, num_blocks, data)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per-layer views `[num_blocks, 2, block_size, kv_heads, head_dim]`."""
        return [self.data[:, layer] for layer in range(self.layout.num_layers)]

    @property
    def block_nbytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def blocks_as_bytes(self) -> torch.Tensor:
        """The pool as `[num_blocks, block_nbytes]` uint8, sharing storage."""
        return self.data.view(self.num_blocks, -1).view(torch.uint8)
