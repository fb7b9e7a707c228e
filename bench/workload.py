"""The work every method in a transfer benchmark moves: one request's KV, shaped like Llama-3-8B.

A workload names the request size, where its blocks sit (scattered or contiguous) and
whose pool layout holds them (kvwire's block-major pool, or vLLM's per-layer K and V
tensors). Every method moves exactly the pieces `KVRegion` makes of it.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvwire.bench.choices import Device, Placement
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.wire import DType, KVLayout, PoolLayout

CHECKSUM_CHUNK = 256 * 2**20  # bytes of a device pool's blocks copied to the host at once to be checksummed
LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=DType.BFLOAT16)


@dataclass(frozen=True)
class Workload:
    tokens: int
    placement: Placement
    pool: PoolLayout = PoolLayout.KVWIRE
    layout: KVLayout = LLAMA3_8B
    seed: int = 0
    device: Device = Device.CPU
    # float32 values per token of the hidden states kvwire's connectors carry beside the KV (a real model's:
    # its hidden size); their time counts in a row's figures, their bytes do not. Peers and limits move KV only.
    hidden_width: int = 1

    def hidden(self) -> torch.Tensor:
        """The request's hidden states, the same in every process: `[tokens, hidden_width]` float32."""
        return torch.arange(self.tokens * self.hidden_width, dtype=torch.float32).view(self.tokens, -1)

    def hidden_received(self, hidden: object) -> bool:
        """Whether a consumer's hidden states are the request's as a connector delivers them: `[tokens,
        hidden_width]` whose last row is the request's (only that row travels: connectors/hidden.py)."""
        want = self.hidden()
        return isinstance(hidden, torch.Tensor) and hidden.shape == want.shape and torch.equal(hidden[-1].cpu(),
                                                                                                want[-1])

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.layout.block_size)

    @property
    def pool_blocks(self) -> int:
        """Each side's pool: twice the request, so scattered ids have room to scatter."""
        return 2 * self.num_blocks

    @property
    def nbytes(self) -> int:
        L = self.layout
        return self.num_blocks * L.num_layers * 2 * L.block_size * L.num_kv_heads * L.head_dim * 2  # bfloat16

    def block_ids(self, side: int) -> list[int]:
        """Block ids on side 0 (producer) or 1 (consumer)."""
        if self.placement == Placement.CONTIGUOUS:
            return list(range(self.num_blocks))
        return random.Random(self.seed * 2 + side).sample(range(self.pool_blocks), self.num_blocks)

    def runs(self, side: int) -> list[tuple[int, int]]:
        """`(first_block, num_blocks)` of each run consecutive on both sides, as seen from `side`."""
        return [(r[side], r[2]) for r in plan_runs(self.block_ids(0), self.block_ids(1))]


def allocate_pool(work: Workload) -> list[torch.Tensor]:
    """A zeroed pool in the workload's layout, as the per-layer tensors the connector contract takes."""
    from kvwire.connectors.kv_pool import TORCH_DTYPES, KVPool

    layout = msgspec.structs.replace(work.layout, pool=work.pool)
    if work.pool == PoolLayout.KVWIRE:
        return KVPool.allocate(layout, work.pool_blocks, str(work.device)).kv_caches
    shape = (2, work.pool_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [torch.zeros(shape, dtype=TORCH_DTYPES[layout.dtype], device=str(work.device))
            for _ in range(layout.num_layers)]


def fill_random(region: KVRegion, seed: int = 1) -> None:
    """Random bytes in every plane of a pool, so verification means something: drawn where the pool lives
    (a GPU pool's gigabytes are not drawn on the host and copied over)."""
    gen = torch.Generator(device=region.planes[0].device).manual_seed(seed)
    for plane in region.planes:
        plane.view(-1).view(torch.int16).random_(generator=gen)


def zero_blocks(region: KVRegion, block_ids: list[int]) -> None:
    for plane in region.planes:
        plane[block_ids] = 0


def checksum(region: KVRegion, block_ids: list[int]) -> int:
    """crc32 of the listed blocks' bytes, plane by plane, in list order. A device plane's blocks are gathered
    on the device and copied over in pieces of up to CHECKSUM_CHUNK bytes, not one small copy per block."""
    crc = 0
    for plane in region.planes:
        if plane.device.type == "cpu":
            for b in block_ids:
                crc = zlib.crc32(plane[b].numpy().data, crc)
            continue
        step = max(1, CHECKSUM_CHUNK // max(1, plane.shape[1]))
        for i in range(0, len(block_ids), step):
            crc = zlib.crc32(plane[block_ids[i:i + step]].cpu().numpy().data, crc)
    return crc


def piece_table(region: KVRegion, runs: list[tuple[int, int]]) -> np.ndarray:
    """The pieces of `runs` as NIXL's descriptors (`descriptors`)."""
    return descriptors(region.pieces(runs))


def descriptors(pieces: Sequence[torch.Tensor]) -> np.ndarray:
    """NIXL's descriptor form of memory pieces: rows `[address, nbytes, device]` (uint64), `device` the CUDA
    device's index for a piece on a GPU (NIXL registers and reads VRAM on that device), 0 for host memory."""
    rows = [[p.data_ptr(), p.numel() * p.element_size(), max(p.get_device(), 0)] for p in pieces]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)
