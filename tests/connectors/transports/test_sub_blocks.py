"""KV between pools of different block sizes: both seen in blocks of the smaller size cut the same pieces, in the
same order, so copying piece to piece puts every token's K and V where the other pool keeps it. The pools are
vLLM 0.32's per-layer views as its backends read them: the CPU backend's (a head page's K transposed, then its V
token by token), a GPU backend's (each token's K and V side by side) and MLA's (a latent a token)."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.sub_blocks import copy_sub_blocks
from kvwire.connectors.vllm.layout import region_of
from tests.connectors.vllm_pages import put, read_kv

LAYERS, HEADS, CONTENT = 2, 3, 8  # CONTENT: a token's K and V, 4 values each


class _Backend:
    """What `region_of` asks of vLLM's attention backend: its name and whether it is MLA."""

    def __init__(self, name: str, mla: bool = False):
        self.name, self.mla = name, mla

    def get_name(self) -> str:
        return self.name

    def is_mla(self) -> bool:
        return self.mla


CPU, GPU, MLA = _Backend("CPU_ATTN"), _Backend("FLASH_ATTN"), _Backend("FLASHMLA", mla=True)


def pool(block_size: int, num_blocks: int, backend: _Backend) -> tuple[dict[str, torch.Tensor], KVRegion]:
    """vLLM 0.32's per-layer views [blocks, heads, block tokens, content] (head-major)."""
    heads = 1 if backend.mla else HEADS
    caches = {f"layer.{i}": torch.zeros(num_blocks, heads, block_size, CONTENT) for i in range(LAYERS)}
    return caches, region_of(caches, num_blocks, block_size, backend=backend)  # type: ignore[arg-type]


def token_kv(layer: int, head: int, token: int) -> torch.Tensor:
    """A token's K (row 0) and V (row 1) in one head of one layer (MLA: its latent, both rows): [2, CONTENT / 2]."""
    return (torch.full((CONTENT,), 1000.0 * layer + 100 * head + token) + torch.arange(CONTENT) / 10).view(2, -1)


def write_prompt(caches: dict[str, torch.Tensor], blocks: list[int], tokens: int, block_size: int,
                 backend: _Backend) -> None:
    for layer, kv in enumerate(caches.values()):
        for t in range(tokens):
            for h in range(kv.shape[1]):
                put(kv, blocks[t // block_size], h, t % block_size, token_kv(layer, h, t), backend is CPU)


def holds_prompt(caches: dict[str, torch.Tensor], blocks: list[int], tokens: int, block_size: int,
                 backend: _Backend) -> bool:
    return all(torch.equal(read_kv(kv, blocks[t // block_size], h, t % block_size, backend is CPU),
                           token_kv(layer, h, t))
               for layer, kv in enumerate(caches.values()) for t in range(tokens) for h in range(kv.shape[1]))


def sub(blocks: list[int], ratio: int, count: int) -> list[int]:
    """`blocks` in sub-blocks of 1/ratio their size, the first `count`."""
    return [b * ratio + i for b in blocks for i in range(ratio)][:count]


@pytest.mark.parametrize("backend", [CPU, GPU, MLA], ids=["cpu", "gpu", "mla"])
@pytest.mark.parametrize(("src_size", "dst_size"), [(8, 4), (4, 8), (8, 2), (4, 4)])
def test_a_prompt_copied_piece_to_piece_between_block_sizes_lands_token_by_token(src_size, dst_size, backend):
    tokens, g = 21, min(src_size, dst_size)
    src_caches, src = pool(src_size, 12, backend)
    dst_caches, dst = pool(dst_size, 16, backend)
    src_blocks = [7, 2, 9, 4, 11, 0][:-(-tokens // src_size)]
    dst_blocks = [3, 14, 1, 8, 5, 12, 6, 10, 13, 15, 0][:-(-tokens // dst_size)]
    write_prompt(src_caches, src_blocks, tokens, src_size, backend)
    a, b = src.sub_blocks(g), dst.sub_blocks(g)
    assert (a.layout.block_size, b.layout.block_size) == (g, g)
    needed = -(-tokens // g)
    src_runs = [(v, 1) for v in sub(src_blocks, src_size // g, needed)]
    dst_runs = [(v, 1) for v in sub(dst_blocks, dst_size // g, needed)]
    pieces, into = a.parts(src_runs), b.parts(dst_runs)
    per_block = HEADS * (CONTENT // 2 + 1) if backend is CPU else HEADS if backend is GPU else 1  # runs a block
    assert len(pieces) == len(into) == a.num_parts(src_runs) == LAYERS * needed * per_block
    assert [p.nbytes for p in pieces] == [p.nbytes for p in into]
    for p, q in zip(pieces, into):
        q[:] = p
    assert holds_prompt(dst_caches, dst_blocks, tokens, dst_size, backend)
    spans = a.spans(src_runs)  # the same pieces by position, as the device paths cut them
    flat = [plane.view(-1) for plane in a.planes]
    assert [bytes(flat[int(p)][int(o):int(o) + int(n)].numpy()) for p, o, n in
            zip(spans.plane, spans.offset, spans.nbytes)] == [bytes(p) for p in pieces]
    assert [bytes(t.numpy()) for t in a.pieces(src_runs)] == [bytes(p) for p in pieces]


def test_a_block_size_that_does_not_divide_or_a_head_slice_is_refused():
    _, region = pool(8, 4, CPU)
    with pytest.raises(ValueError, match="blocks of 8 tokens do not split into blocks of 3"):
        region.sub_blocks(3)
    with pytest.raises(ValueError, match="not seen in sub-blocks again"):
        region.sub_blocks(4).sub_blocks(2)
    with pytest.raises(ValueError, match="no rows to copy"):
        region.sub_blocks(4).row_views()
    assert region.sub_blocks(4).num_blocks == 8 and region.sub_blocks(4).block_nbytes * 2 == region.block_nbytes


@pytest.mark.parametrize("backend", [CPU, GPU, MLA], ids=["cpu", "gpu", "mla"])
@pytest.mark.parametrize(("src_size", "dst_size"), [(8, 4), (4, 8), (8, 2)])
def test_sub_blocks_copied_whole_and_packed_back_to_back_are_the_pieces(src_size, dst_size, backend):
    """`copy_sub_blocks` (a strided copy a sub-block and part) lands the prompt as the piece-to-piece copy does, and
    packed back to back (`SubBlocks.packed`) the sub-blocks are the pieces' bytes in their order: the stream a
    transport sends, however it was cut."""
    tokens, g = 21, min(src_size, dst_size)
    src_caches, src = pool(src_size, 12, backend)
    dst_caches, dst = pool(dst_size, 16, backend)
    src_blocks, dst_blocks = [7, 2, 9, 4, 11, 0][:-(-tokens // src_size)], [3, 14, 1, 8, 5, 12, 6, 10, 13, 15, 0]
    write_prompt(src_caches, src_blocks, tokens, src_size, backend)
    a, b = src.sub_blocks(g), dst.sub_blocks(g)
    needed = -(-tokens // g)
    src_ids = torch.tensor(sub(src_blocks, src_size // g, needed))
    dst_ids = torch.tensor(sub(dst_blocks[:-(-tokens // dst_size)], dst_size // g, needed))
    assert a.split is not None and b.split is not None
    packed = a.split.packed()
    staging = [torch.empty(needed, packed.block_nbytes, dtype=torch.uint8) for _ in a.planes]
    copy_sub_blocks(a.planes, a.split, src_ids, staging, packed, torch.arange(needed))
    stream = b"".join(bytes(p) for p in a.parts([(int(v), 1) for v in src_ids]))
    assert b"".join(bytes(s.numpy()) for s in staging) == stream
    copy_sub_blocks(staging, packed, torch.arange(needed), b.planes, b.split, dst_ids)
    assert holds_prompt(dst_caches, dst_blocks, tokens, dst_size, backend)


def test_sub_blocks_of_a_head_slice_are_copied_and_pairs_are_checked():
    src_caches, src = pool(8, 4, CPU)
    write_prompt(src_caches, [2], 8, 8, CPU)
    sliced = src.heads(1, 2, True).sub_blocks(4)  # heads 1 and 2 of 3, in blocks of 4
    assert sliced.split is not None and sliced.split.first_unit == 1
    packed = sliced.split.packed()
    staging = [torch.empty(2, packed.block_nbytes, dtype=torch.uint8) for _ in sliced.planes]
    copy_sub_blocks(sliced.planes, sliced.split, torch.tensor([4, 5]), staging, packed, torch.arange(2))
    assert b"".join(bytes(s.numpy()) for s in staging) == b"".join(bytes(p) for p in sliced.parts([(4, 2)]))
    with pytest.raises(ValueError, match="do not pair"):
        copy_sub_blocks(sliced.planes, sliced.split, torch.tensor([4]), staging, src.sub_blocks(4).split.packed(),
                        torch.tensor([0]))
