"""The work every method in a transfer benchmark moves: one request's KV, shaped like Llama-3-8B."""

from __future__ import annotations

import enum
import random
import zlib
from dataclasses import dataclass

import torch

from connectors.wire import DType, KVLayout

LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=DType.BFLOAT16)


class Placement(enum.StrEnum):
    SCATTERED = "scattered"  # random, different block ids on each side: nothing merges
    CONTIGUOUS = "contiguous"  # blocks 0..n-1 on both sides: one run


@dataclass(frozen=True)
class Workload:
    tokens: int
    placement: Placement
    layout: KVLayout = LLAMA3_8B
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.layout.block_size)

    @property
    def pool_blocks(self) -> int:
        """Each side's pool: twice the request, so scattered ids have room to scatter."""
        return 2 * self.num_blocks

    def block_ids(self, side: int) -> list[int]:
        """Block ids on side 0 (sender) or 1 (receiver)."""
        if self.placement == Placement.CONTIGUOUS:
            return list(range(self.num_blocks))
        return random.Random(self.seed * 2 + side).sample(range(self.pool_blocks), self.num_blocks)


def fill_random(pool_data: torch.Tensor, seed: int = 1) -> None:
    """Random bytes in a whole pool (any dtype), so verification means something."""
    flat = pool_data.view(-1).view(torch.int16)
    flat.random_(generator=torch.Generator().manual_seed(seed))


def checksum(plane: torch.Tensor, block_ids: list[int]) -> int:
    """crc32 of the listed blocks' bytes, in list order. plane: [num_blocks, block_nbytes] uint8."""
    crc = 0
    for b in block_ids:
        crc = zlib.crc32(plane[b].numpy(), crc)
    return crc
