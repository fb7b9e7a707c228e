"""The KV pool seen as bytes: which pieces of memory hold a given list of blocks.

A pool is one or more *planes*, each `[num_blocks, plane_block_nbytes]` uint8 with
contiguous rows. kvwire's block-major pool is a single plane (a block holds every
layer's K and V), so a run of consecutive blocks is one piece; vLLM's pool (one tensor
`[2, num_blocks, block_size, kv_heads, head_dim]` per layer) has a K plane and a V plane
per layer, so the same run is 2 x num_layers pieces.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import msgspec
import torch

from kvwire.connectors.transports.sub_blocks import SubBlocks, unpack
from kvwire.connectors.wire import KVLayout, KVLocation, PoolLayout

# pools whose plane rows hold a block's KV heads one after another (a head slice is a byte range of a row)
HEAD_MAJOR = frozenset({PoolLayout.VLLM_CPU, PoolLayout.VLLM_HNC, PoolLayout.VLLM_MLA})


def plan_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Split a block-to-block copy into maximal runs consecutive on both sides.

    Returns:
        `(src_start, dst_start, num_blocks)` triples covering the lists in order.
    Raises:
        ValueError: the lists differ in length.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view of the same memory."""
    assert t.is_contiguous(), "only contiguous tensors travel as raw buffers"
    return t.reshape(-1).view(torch.uint8)


Part = memoryview | torch.Tensor  # a piece's bytes: host memory as a memoryview, device memory as a flat uint8 tensor


def byte_parts(tensors: list[torch.Tensor]) -> list[Part]:
    """The tensors' bytes: memoryviews sharing CPU tensors' memory, flat uint8 views of CUDA ones.

    Raises:
        ValueError: a tensor on a device other than the CPU or CUDA.
    """
    return [_flat_part(as_bytes(t)) for t in tensors]


def part_nbytes(part: Part) -> int:
    return part.nbytes if isinstance(part, memoryview) else part.numel()


def _flat_part(flat: torch.Tensor) -> Part:
    if flat.device.type == "cpu":
        return flat.numpy().data  # memoryview(flat.numpy()), as numpy types it for Python 3.11
    if flat.device.type == "cuda":
        return flat
    raise ValueError(f"kvwire cannot move tensors on {flat.device}")


@dataclass(frozen=True)
class Spans:
    """Pieces by position: piece i is bytes `[offset[i], offset[i] + nbytes[i])` of plane `plane[i]`'s memory."""

    plane: torch.Tensor  # [pieces] int64, an index into the region's planes
    offset: torch.Tensor  # [pieces] int64, bytes from the plane's start
    nbytes: torch.Tensor  # [pieces] int64


def blocks_of(runs: list[tuple[int, int]]) -> torch.Tensor:
    """Every block of the runs `(first, count)`, in order: `[blocks]` int64."""
    return _blocks(torch.tensor([s for s, _ in runs], dtype=torch.int64),
                   torch.tensor([n for _, n in runs], dtype=torch.int64))


def _blocks(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every block of the runs `(starts[i], counts[i])`, in order: `[sum(counts)]` int64."""
    first = torch.repeat_interleave(starts, counts)
    ends = torch.cumsum(counts, 0)
    return first + torch.arange(int(ends[-1]) if len(ends) else 0) - torch.repeat_interleave(ends - counts, counts)


@dataclass(frozen=True)
class KVRegion:
    planes: tuple[torch.Tensor, ...]  # each [num_blocks, plane_block_nbytes] uint8
    layout: KVLayout
    # A head slice's bytes `[lo, hi)` of every plane's rows (`heads`); None: whole rows. A slice's blocks are
    # pieces of their own (consecutive blocks' slices are not adjacent), on both sides of a pull.
    rows: tuple[int, int] | None = None
    # Blocks smaller than the planes' rows (`sub_blocks`: a pull between pools of different block sizes); the
    # layout's block_size is then theirs, and block ids count them.
    split: SubBlocks | None = None

    def of_model(self, model: str, kv_quant: str = "") -> KVRegion:
        """This region, its layout naming the checkpoint `model` (its fingerprint: connectors/checkpoint.py) and
        the quantization of its KV cache (KVLayout.kv_quant)."""
        return dataclasses.replace(self, layout=msgspec.structs.replace(self.layout, model=model, kv_quant=kv_quant))

    @classmethod
    def from_kv_caches(cls, kv_caches: list[torch.Tensor]) -> KVRegion:
        """Recover the planes behind the contract's per-layer tensors (the layout names no checkpoint: `of_model`).

        Per-layer views `[num_blocks, 2, ...]` of one block-major tensor (kvwire's pool)
        give one plane; separate contiguous per-layer tensors `[2, num_blocks, ...]`
        (vLLM's pool) give a K and a V plane per layer.
        """
        from kvwire.connectors.hidden import dtype_of

        if not kv_caches:
            raise ValueError("no KV caches to register")
        base = kv_caches[0]._base
        planes: tuple[torch.Tensor, ...]
        if base is not None and all(kv._base is base for kv in kv_caches) and _block_major(base, kv_caches):
            planes, pool, shape = (base.view(base.shape[0], -1).view(torch.uint8),), PoolLayout.KVWIRE, base.shape[3:]
        elif all(kv.is_contiguous() and kv.dim() == 5 and kv.shape[0] == 2 for kv in kv_caches):
            planes = tuple(kv[half].view(kv.shape[1], -1).view(torch.uint8) for kv in kv_caches for half in (0, 1))
            pool, shape = PoolLayout.VLLM, kv_caches[0].shape[2:]
        else:
            raise ValueError("KV caches are neither block-major views of one pool (kvwire) nor contiguous "
                             "per-layer [2, num_blocks, block_size, kv_heads, head_dim] tensors (vLLM)")
        if len({p.shape for p in planes}) != 1 and pool == PoolLayout.VLLM:
            raise ValueError(f"per-layer KV tensors differ in shape: {sorted({tuple(kv.shape) for kv in kv_caches})}")
        block_size, heads, head_dim = shape
        layout = KVLayout(num_layers=len(kv_caches), num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
                          dtype=dtype_of(kv_caches[0]), pool=pool)
        return cls(planes, layout)

    @property
    def num_blocks(self) -> int:
        return self.planes[0].shape[0] * (self.split.ratio if self.split else 1)

    @property
    def block_nbytes(self) -> int:
        if self.rows is not None:
            return (self.rows[1] - self.rows[0]) * len(self.planes)
        if self.split is not None:
            return self.split.block_nbytes * len(self.planes)
        return sum(p.shape[1] for p in self.planes)

    def sub_blocks(self, block_size: int) -> KVRegion:
        """This region (a head slice of it, too) in blocks of `block_size` tokens, theirs or a divisor
        (connectors/transports/sub_blocks.py): a piece per run of tokens of a row, for a pull between pools of
        different block sizes.

        Raises:
            ValueError: kvwire's own pool, or a block size that does not divide this one's.
        """
        if self.split is not None:
            raise ValueError("a region in sub-blocks is not seen in sub-blocks again")
        row, layout, heads = self.planes[0].shape[1], self.layout, None
        if self.rows is not None:  # a head slice of head-major rows: its heads' units
            lo, hi = self.rows
            per_head = (hi - lo) // layout.num_kv_heads
            heads = (lo // per_head, layout.num_kv_heads)
            layout = msgspec.structs.replace(layout, num_kv_heads=row // per_head)
        split = SubBlocks.of(layout, block_size, row, heads)
        return KVRegion(self.planes, msgspec.structs.replace(self.layout, block_size=block_size), split=split)

    def heads(self, first: int, count: int, per_block: bool = True) -> KVRegion:
        """The region of KV heads `[first, first + count)` only: in vLLM's head-major layouts (a plane's row
        holds its heads one after another) a contiguous byte range of every row. `per_block` False with
        every head: this region itself (whole rows, runs of blocks as one piece).

        Raises:
            ValueError: a layout whose heads are not contiguous runs of a row, or a slice out of range.
        """
        if self.split is not None:
            raise ValueError("a region in sub-blocks is not sliced by heads")
        rows = head_rows(self.layout, self.planes[0].shape[1], first, count, per_block)
        if rows is None:
            return self
        if self.rows is not None:
            raise ValueError("a head slice cannot be sliced again")
        return KVRegion(self.planes, msgspec.structs.replace(self.layout, num_kv_heads=count), rows)

    def row_views(self) -> tuple[torch.Tensor, ...]:
        """Each plane as `[num_blocks, row]` uint8 views of just the bytes this region moves per block (a head
        slice's columns; whole rows otherwise): what a copy between two regions reads or writes."""
        if self.split is not None:
            raise ValueError("a region in sub-blocks has no rows to copy: its pieces are runs of rows")
        if self.rows is None:
            return self.planes
        lo, hi = self.rows
        return tuple(plane[:, lo:hi] for plane in self.planes)

    def num_parts(self, runs: list[tuple[int, int]]) -> int:
        """How many pieces `parts(runs)` (and `pieces`) make."""
        per_plane = sum(n for _, n in runs) if self.rows is not None else len(runs)
        if self.split is not None:
            per_plane = sum(n for _, n in runs) * self.split.pieces_per_block
        return per_plane * len(self.planes)

    def pieces(self, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Flat uint8 views, plane by plane, of each `(first_block, num_blocks)` run (a head slice: of each
        block of each run)."""
        if self.split is not None:
            spans = self.spans(runs)
            flats = [plane.view(-1) for plane in self.planes]
            return [flats[p][o:o + n] for p, o, n in zip(spans.plane.tolist(), spans.offset.tolist(),
                                                          spans.nbytes.tolist())]
        if self.rows is not None:
            lo, hi = self.rows
            return [plane[b, lo:hi] for plane in self.planes for start, n in runs for b in range(start, start + n)]
        return [plane[start:start + n].view(-1) for plane in self.planes for start, n in runs]

    def parts(self, runs: list[tuple[int, int]]) -> list[Part]:
        """The same pieces as `pieces(runs)`, as `Part`s: on the CPU, slices of one memoryview per plane,
        much cheaper to make than tensor views (docs/BENCHMARKS.md); what a transport that takes buffers wants."""
        out: list[Part] = []
        for p in range(len(self.planes)):
            out += self._plane_parts(p, runs)
        return out

    def _plane_parts(self, p: int, runs: list[tuple[int, int]]) -> list[Part]:
        flat, plane = self._flat_planes[p], self.planes[p]
        step = plane.shape[1]
        if self.split is not None:
            offsets, sizes = self.split.offsets(blocks_of(runs), plane.stride(0))
            return [flat[o:o + n] for o, n in zip(offsets.tolist(), sizes.tolist())]
        if self.rows is None:
            return [flat[start * step:(start + n) * step] for start, n in runs]
        lo, hi = self.rows
        return [flat[b * step + lo:b * step + hi] for start, n in runs for b in range(start, start + n)]

    def layer_parts(self, runs: list[tuple[int, int]], layer: int) -> list[Part]:
        """One layer's K and V in `runs`, as `Part`s: in vLLM's pools its plane's runs (K plane's, then V's);
        in kvwire's pool (a block's row holds every layer) one slice of each block's row."""
        if self.layout.pool != PoolLayout.KVWIRE:  # vLLM's layouts: one or two planes per layer
            out: list[Part] = []
            per = len(self.planes) // self.layout.num_layers
            for p in range(per * layer, per * (layer + 1)):
                out += self._plane_parts(p, runs)
            return out
        flat, step = self._flat_planes[0], self.planes[0].shape[1]
        per_layer = step // self.layout.num_layers
        lo = layer * per_layer
        return [flat[b * step + lo:b * step + lo + per_layer] for start, n in runs for b in range(start, start + n)]

    def layer_major_parts(self, runs: list[tuple[int, int]]) -> list[Part]:
        """Every layer's `layer_parts`, layer 0 first: the order a layer-wise stream sends (and lands) them."""
        return [part for layer in range(self.layout.num_layers) for part in self.layer_parts(runs, layer)]

    def spans(self, runs: list[tuple[int, int]], layer_major: bool = False) -> Spans:
        """The pieces `parts(runs)` (`layer_major`: `layer_major_parts(runs)`) cuts, in the same order, by position
        instead of by view: a few tensor ops, where a view each costs microseconds of Python (8,192 of them for a
        2,048-token request in vLLM's pool).

        Raises:
            ValueError: a run outside the planes.
        """
        starts = torch.tensor([s for s, _ in runs], dtype=torch.int64)  # [runs]
        counts = torch.tensor([n for _, n in runs], dtype=torch.int64)  # [runs]
        if runs and (int(starts.min()) < 0 or int(counts.min()) < 0 or int((starts + counts).max()) > self.num_blocks):
            raise ValueError(f"runs {runs} outside planes of {self.num_blocks} blocks")
        steps = torch.tensor([p.shape[1] for p in self.planes], dtype=torch.int64)  # [planes] bytes a row
        if layer_major and self.layout.pool == PoolLayout.KVWIRE:  # one plane; a layer is a slice of every row
            per_layer = int(steps[0]) // self.layout.num_layers
            blocks = _blocks(starts, counts)  # [blocks]
            layers = torch.arange(self.layout.num_layers, dtype=torch.int64)
            offset = (blocks[None, :] * steps[0] + layers[:, None] * per_layer).flatten()  # [layers * blocks]
            return Spans(torch.zeros_like(offset), offset, torch.full_like(offset, per_layer))
        planes = torch.arange(len(self.planes), dtype=torch.int64)
        if self.split is not None:  # a piece per run of tokens of each sub-block
            blocks = _blocks(starts, counts)
            cut = [self.split.offsets(blocks, plane.stride(0)) for plane in self.planes]
            per_plane = len(blocks) * self.split.pieces_per_block
            return Spans(planes.repeat_interleave(per_plane), torch.cat([o for o, _ in cut]),
                         torch.cat([n for _, n in cut]))  # each [planes * pieces]
        if self.rows is None:  # a run of whole rows is one piece (vLLM's layer-major order is its plane order)
            offset, nbytes = starts[None, :] * steps[:, None], counts[None, :] * steps[:, None]  # [planes, runs]
            return Spans(planes.repeat_interleave(len(runs)), offset.flatten(), nbytes.flatten())
        lo, hi = self.rows  # a head slice: a piece per block
        blocks = _blocks(starts, counts)
        offset = (blocks[None, :] * steps[:, None] + lo).flatten()  # [planes * blocks]
        return Spans(planes.repeat_interleave(len(blocks)), offset, torch.full_like(offset, hi - lo))

    @cached_property
    def _flat_planes(self) -> tuple[Part, ...]:
        return tuple(_flat_part(plane.view(-1)) for plane in self.planes)


def same_planes(a: KVRegion, b: KVRegion) -> bool:
    """Whether two regions are views of the very same planes (whole rows)."""
    def geometry(r: KVRegion) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return [(p.data_ptr(), tuple(p.shape), p.stride()) for p in r.planes]

    return a.rows is None and b.rows is None and a.split is None and b.split is None and geometry(a) == geometry(b)


def head_rows(layout: KVLayout, row_nbytes: int, first: int, count: int,
              per_block: bool = True) -> tuple[int, int] | None:
    """The bytes `[lo, hi)` of a plane's row of `row_nbytes` that hold KV heads `[first, first + count)`; None for
    whole rows (every head, not `per_block`: runs of blocks then move as one piece).

    Raises:
        ValueError: a layout whose heads are not contiguous runs of a row, or a slice out of range.
    """
    heads = layout.num_kv_heads
    if not per_block and (first, count) == (0, heads):
        return None
    if layout.pool not in HEAD_MAJOR:
        raise ValueError(f"a {layout.pool} pool cannot be sliced by KV head")
    if first < 0 or count < 0 or first + count > heads:
        raise ValueError(f"heads [{first}, {first + count}) are not among this pool's {heads}")
    step = row_nbytes // heads
    return first * step, (first + count) * step


def _block_major(base: torch.Tensor, kv_caches: list[torch.Tensor]) -> bool:
    return (
        base.is_contiguous()
        and base.dim() == 6
        and base.shape[1] == len(kv_caches)
        and all(kv.shape[0] == base.shape[0] for kv in kv_caches)
    )


def consumer_pieces(region: KVRegion, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor],
                    max_pieces: int | None = None) -> list[torch.Tensor]:
    """Where a pull of `loc` lands on the consumer: its block runs (of the head slice `loc.heads` names, if
    any), then the hidden tensors, in the order producers send.

    Raises:
        TransferError: more pieces than the transport can tag.
    """
    region, runs = consumer_runs(region, loc, dst_blocks, len(hidden), max_pieces)
    return region.pieces(runs) + hidden


def consumer_stream(region: KVRegion, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor],
                    max_pieces: int | None = None) -> tuple[list[Part], Callable[[], None] | None]:
    """`consumer_pieces` as `Part`s, for transports that take buffers (the blocks layer by layer for a layer-wise
    location, as its producer sends them: `KVRegion.layer_major_parts`), and what to do once they are filled. A
    pull that `packs` lands in one staging buffer (as `SendJob.stream_parts` sends it), which the callable returned
    unpacks into its blocks once the pull is complete; None: the parts are the blocks themselves."""
    narrowed, runs = consumer_runs(region, loc, dst_blocks, len(hidden), max_pieces)
    if not packs(narrowed, loc.layerwise):
        kv = narrowed.layer_major_parts(runs) if loc.layerwise else narrowed.parts(runs)
        return kv + byte_parts(hidden), None
    assert narrowed.split is not None  # packs() says so
    ids = blocks_of(runs)
    staging = torch.empty(len(narrowed.planes), len(ids), narrowed.split.block_nbytes, dtype=torch.uint8)
    return byte_parts([staging, *hidden]), functools.partial(unpack, staging, narrowed.split, ids, narrowed.planes)


def packs(region: KVRegion, layer_major: bool = False) -> bool:
    """Whether a byte stream moves `region`'s blocks packed (sub_blocks.pack): sub-blocks of host planes, not
    layer by layer. A device pool's go piece by piece through the stream's device staging as before."""
    return region.split is not None and not layer_major and all(p.device.type == "cpu" for p in region.planes)


def consumer_runs(region: KVRegion, loc: KVLocation, dst_blocks: list[int], n_hidden: int,
                  max_pieces: int | None) -> tuple[KVRegion, list[tuple[int, int]]]:
    """The region a pull of `loc` lands in (its head slice, or its sub-blocks, if any) and its runs of destination
    blocks there.

    Raises:
        TransferError: more pieces than `max_pieces`.
    """
    from kvwire.connectors.base import TransferError

    if loc.heads is not None:
        region = region.heads(loc.heads.dst_head, loc.heads.num_heads, loc.heads.per_block)
    if loc.pull_block_size:
        region = region.sub_blocks(loc.pull_block_size)
    runs = [(d, n) for _, d, n in plan_runs(loc.block_ids, dst_blocks)]
    count = region.num_parts(runs) + n_hidden
    if max_pieces is not None and count > max_pieces:
        raise TransferError(loc.request_id, loc.producer, f"{count} pieces exceed {max_pieces}")
    return region, runs
