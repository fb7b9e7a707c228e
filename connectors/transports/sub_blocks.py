"""A pool seen in blocks smaller than its own: how KV moves between pools of different block sizes.

vLLM servers may keep KV blocks of different sizes (a prefill server of 128-token blocks, a decode server of 64;
different attention backends or hardware). A pull between them moves the KV in blocks of the smaller size, on
both sides (KVRegion.sub_blocks). A plane row, one block of `ratio * tokens` tokens, is `units` units one after
another (a KV head's page, or the whole row), each unit the same `parts`; a part is `runs` runs, one after another,
each run the block's tokens in order, `token_nbytes` bytes a token. Sub-block `i` of a block is, in every run, the
bytes of tokens `[i * tokens, (i + 1) * tokens)`: one piece per run, unit by unit, part by part, run by run. So:

- vLLM's head-major rows on GPUs (each token's K and V side by side): a unit per head, one part of one run;
- vLLM's CPU backend (its `vec` and `vec16` kernels): a unit per head, its K part stored transposed (a run per
  element of head_dim, the block's tokens in each) and its V part one run, token by token;
- MLA's latent rows and the older `[block_size, heads, head_dim]` planes: one run; `[2, block_size, ...]` planes:
  K's run and V's.

Both sides cut the same pieces in the same order (the smaller side's own blocks are sub-blocks of ratio 1, still a
piece per run), so every transport pairs them as it pairs whole blocks. Sub-block `v` lies in block `v // ratio`.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvwire.connectors.kv_pool import TORCH_DTYPES
from kvwire.connectors.wire import DType, KVLayout, PoolLayout

Part = tuple[int, int]  # (runs, bytes a token in each run)


@dataclass(frozen=True)
class SubBlocks:
    """Each plane row (a block of `ratio * tokens` tokens) seen as `ratio` blocks of `tokens` (module docstring)."""

    ratio: int
    tokens: int
    units: int  # the units cut, from `first_unit` on (a tensor-parallel head slice: its heads)
    parts: tuple[Part, ...]
    first_unit: int = 0

    @classmethod
    def of(cls, layout: KVLayout, tokens: int, row_nbytes: int, heads: tuple[int, int] | None = None) -> SubBlocks:
        """`layout`'s blocks, rows of `row_nbytes`, seen in blocks of `tokens`; `heads`: only KV heads `[first,
        first + count)` (a head-major row's units are its heads).

        Raises:
            ValueError: a pool whose rows are not runs of tokens (kvwire's own: a block holds every layer; the CPU
                backend's AMX and non-x86 kernels, whose pages kvwire does not know), or a block size that `tokens`
                does not divide.
        """
        if tokens <= 0 or layout.block_size % tokens:
            raise ValueError(f"blocks of {layout.block_size} tokens do not split into blocks of {tokens}")
        units, parts = _row_of(layout, row_nbytes)
        first, count = heads or (0, units)
        if heads is not None and (units != layout.num_kv_heads or first + count > units):
            raise ValueError(f"heads {first}+{count} of a {layout.pool} row of {units} units")
        return cls(layout.block_size // tokens, tokens, count, parts, first)

    @property
    def pieces_per_block(self) -> int:
        return self.units * sum(runs for runs, _ in self.parts)

    @property
    def block_nbytes(self) -> int:
        """The bytes of one sub-block of a plane (of its units)."""
        return self.units * sum(runs * self.tokens * token for runs, token in self.parts)

    def offsets(self, blocks: torch.Tensor, row_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each piece of sub-blocks `blocks` (int64) starts in a plane whose rows are `row_stride` bytes apart,
        and its bytes: two `[len(blocks) * pieces_per_block]` int64 tensors, sub-block by sub-block, then unit,
        part and run."""
        block_tokens = self.ratio * self.tokens
        starts, sizes = [], []
        at = self.first_unit * sum(runs * block_tokens * token for runs, token in self.parts)
        for _ in range(self.units):
            for runs, token in self.parts:
                run = torch.arange(runs, dtype=torch.int64) * (block_tokens * token)  # [runs]
                starts.append(at + run)
                sizes.append(torch.full((runs,), self.tokens * token, dtype=torch.int64))
                at += runs * block_tokens * token
        within, nbytes = torch.cat(starts), torch.cat(sizes)  # [pieces_per_block]: a sub-block 0's pieces
        token_bytes = torch.cat([torch.full((runs,), token, dtype=torch.int64)
                                 for _ in range(self.units) for runs, token in self.parts])
        base = (blocks // self.ratio) * row_stride  # [blocks]
        shift = (blocks % self.ratio)[:, None] * (self.tokens * token_bytes)[None, :]  # [blocks, pieces]
        return (base[:, None] + within[None, :] + shift).flatten(), nbytes.repeat(len(blocks))


    def packed(self) -> SubBlocks:
        """The same sub-blocks, back to back: rows of one sub-block of the units alone, the bytes a pull's pieces of
        one plane make in their order (unit, part, run); a transport's staging for a pull moved whole."""
        return SubBlocks(1, self.tokens, self.units, self.parts)

    def part_views(self, plane: torch.Tensor) -> list[torch.Tensor]:
        """`plane` (`[rows, row bytes]` uint8, rows of `ratio * tokens` tokens), one view per part: `[rows, ratio,
        units, runs, tokens * token bytes]`, so that `[row, j]` is sub-block `row * ratio + j`'s part."""
        block_tokens = self.ratio * self.tokens
        unit = sum(runs * block_tokens * token for runs, token in self.parts)
        at, views = plane.storage_offset() + self.first_unit * unit, []
        for runs, token in self.parts:
            views.append(plane.as_strided((plane.shape[0], self.ratio, self.units, runs, self.tokens * token),
                                          (plane.stride(0), self.tokens * token, unit, block_tokens * token, 1), at))
            at += runs * block_tokens * token
        return views


def copy_sub_blocks(src: Sequence[torch.Tensor], src_split: SubBlocks, src_ids: torch.Tensor,
                    dst: Sequence[torch.Tensor], dst_split: SubBlocks, dst_ids: torch.Tensor) -> None:
    """Sub-blocks `src_ids` of planes `src` (seen as `src_split`) into sub-blocks `dst_ids` of planes `dst` (as
    `dst_split`), plane by plane: one strided copy per sub-block and part, where the pieces are thousands (a
    million 128-byte pieces for a 2,048-token Llama-3-8B request in vLLM's CPU layout). The ids are `[n]` int64.

    Raises:
        ValueError: splits that do not pair (other sub-block sizes, units or parts), or id lists of two lengths.
    """
    if (src_split.tokens, src_split.units, src_split.parts) != (dst_split.tokens, dst_split.units, dst_split.parts):
        raise ValueError(f"sub-blocks {src_split} do not pair with {dst_split}")
    if len(src_ids) != len(dst_ids) or len(src) != len(dst):
        raise ValueError(f"{len(src_ids)} sub-blocks of {len(src)} planes into {len(dst_ids)} of {len(dst)}")
    pairs = list(zip(torch.stack([src_ids // src_split.ratio, src_ids % src_split.ratio], 1).tolist(),
                     torch.stack([dst_ids // dst_split.ratio, dst_ids % dst_split.ratio], 1).tolist()))
    for s_plane, d_plane in zip(src, dst):
        for s_view, d_view in zip(src_split.part_views(s_plane), dst_split.part_views(d_plane)):
            for (s_row, s_j), (d_row, d_j) in pairs:
                d_view[d_row, d_j].copy_(s_view[s_row, s_j])


def pack(planes: Sequence[torch.Tensor], split: SubBlocks, ids: torch.Tensor) -> torch.Tensor:
    """Sub-blocks `ids` of `planes` (seen as `split`) back to back, plane by plane: `[planes, len(ids),
    split.block_nbytes]` uint8, the bytes their pieces make in a pull's order (a byte stream's whole payload)."""
    out = torch.empty(len(planes), len(ids), split.block_nbytes, dtype=torch.uint8, device=planes[0].device)
    copy_sub_blocks(planes, split, ids, list(out), split.packed(), torch.arange(len(ids)))
    return out


def unpack(packed: torch.Tensor, split: SubBlocks, ids: torch.Tensor, planes: Sequence[torch.Tensor]) -> None:
    """`pack`'s reverse: `packed` (`[planes, len(ids), split.block_nbytes]`) into sub-blocks `ids` of `planes`."""
    copy_sub_blocks(list(packed), split.packed(), torch.arange(len(ids)), planes, split, ids)


def _row_of(layout: KVLayout, row_nbytes: int) -> tuple[int, tuple[Part, ...]]:
    """`(units, parts)` of a row of `layout` (module docstring)."""
    n, heads = layout.block_size, layout.num_kv_heads
    elem = torch.empty((), dtype=TORCH_DTYPES[layout.dtype]).element_size()
    if layout.pool in (PoolLayout.VLLM, PoolLayout.VLLM_MLA):
        return 1, ((1, row_nbytes // n),)
    if layout.pool == PoolLayout.VLLM_BLOCK_FIRST:
        return 1, ((2, row_nbytes // (2 * n)),)
    if layout.pool == PoolLayout.VLLM_HNC:
        return heads, ((1, row_nbytes // (heads * n)),)
    if layout.pool == PoolLayout.VLLM_CPU and _cpu_pages_known(layout):
        return heads, ((layout.head_dim, elem), (1, layout.head_dim * elem))
    raise ValueError(f"kvwire does not know how a block of a {layout.pool} pool splits by tokens here: give both "
                     "sides the same --block-size")


def _cpu_pages_known(layout: KVLayout) -> bool:
    """Whether vLLM's CPU backend keeps this layout's pages as kvwire knows them (its `vec` and `vec16` kernels: K
    transposed, V token by token), not in AMX tiles (bf16 on a CPU with AMX) nor another architecture's."""
    if platform.machine().lower() not in ("x86_64", "amd64") or layout.kv_quant:
        return False  # another architecture's kernels, or a quantized cache's pages: not known
    amx = layout.dtype == DType.BFLOAT16 and layout.block_size % 32 == 0 and torch.cpu._is_amx_tile_supported()
    return not amx
