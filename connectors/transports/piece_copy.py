"""One pull's pieces in device memory, known by address: a pack is one kernel, not a view and a copy per piece.

vLLM's per-layer pool cuts a 2,048-token request into 8,192 pieces of 32 KiB. UCX's device packing
(ucx/packing.py) sends them in 8 MiB slots, but each piece was still a CUDA tensor view made in Python
(a few microseconds each, on both sides, before the first byte moved) and an input of `torch.cat` or
an output of `torch.split_with_sizes_copy`. `DevicePieces` keeps the pieces as a table instead
(`KVRegion.spans`: their planes and offsets, a few tensor ops for the whole pull), uploaded to the
device once per pull: address, size and place in the packed stream of every piece. A pack is then one
Triton launch (`gather`: the pieces into a slot, back to back; `scatter`: the reverse), and a view
is made only for a piece that travels alone.

Lifecycle: built when a pull starts (producer: the job's pieces; consumer: its destination blocks),
it holds the region's planes until the pull ends, so no piece's memory can go while a kernel reads it.
Where the kernel cannot run (no Triton, a build that fails: row_copy's one log line and its count; a pack
holding hidden states on another device) `gather`/`scatter` return False and the caller copies the views.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch

from kvwire.connectors.transports import row_copy
from kvwire.connectors.transports.kv_region import KVRegion, Part, Spans, byte_parts, part_nbytes
from kvwire.connectors.transports.row_copy import triton

WORDS_PER_PROGRAM = 1024  # words one program copies: a 32 KiB piece is four programs of 8 KiB (8-byte words)

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["first", "slot"])
    def _copy_pieces(address, nbytes, position, first, slot, TO_SLOT: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK: tl.constexpr):
        """Program (j, chunk): chunk `chunk` of piece first + j, between its address and its place in the slot
        (its position in the stream less the pack's first piece's)."""
        i = first + tl.program_id(0)
        piece = tl.load(address + i)
        packed = slot + tl.load(position + i) - tl.load(position + first)
        if TO_SLOT:
            src = piece
            dst = packed
        else:
            src = packed
            dst = piece
        n = tl.load(nbytes + i)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if WIDE:
            mask = offs < n // 8
            s = src.to(tl.pointer_type(tl.int64))
            d = dst.to(tl.pointer_type(tl.int64))
        else:
            mask = offs < n
            s = src.to(tl.pointer_type(tl.uint8))
            d = dst.to(tl.pointer_type(tl.uint8))
        tl.store(d + offs, tl.load(s + offs, mask=mask), mask=mask)


class DevicePieces(Sequence[Part]):
    """The pieces of one pull, as `KVRegion.parts` would cut them (blocks, then `hidden`), in one device's memory.

    Indexing makes the view of one piece (for a piece that travels alone); `sizes` are every piece's bytes.

    Args:
        spans: `region.spans(...)` of the pull's runs.
        hidden: the hidden-state tensors that follow the blocks (contiguous).
    """

    def __init__(self, region: KVRegion, spans: Spans, hidden: Sequence[torch.Tensor] = ()):
        self._flat = [plane.view(-1) for plane in region.planes]
        self._spans = spans
        self._hidden = byte_parts(list(hidden))
        self.sizes: list[int] = spans.nbytes.tolist() + [part_nbytes(p) for p in self._hidden]
        self.device = region.planes[0].device
        bases = torch.tensor([p.data_ptr() for p in self._flat], dtype=torch.int64)  # [planes]
        extra = [h.data_ptr() for h in hidden]
        self._address = torch.cat([bases[spans.plane] + spans.offset, torch.tensor(extra, dtype=torch.int64)])
        # the kernel copies the hidden states' packs too where they are on the pool's device (else their views)
        self._reach = len(self.sizes) if all(h.device == self.device for h in hidden) else len(spans.offset)
        self._table: tuple[torch.Tensor, ...] | None = None  # on the device once the first pack asks
        self._pinned: torch.Tensor | None = None  # the table's host copy, alive until its upload is surely done
        self._wide = False

    def __len__(self) -> int:
        return len(self.sizes)

    @overload
    def __getitem__(self, i: int) -> Part: ...
    @overload
    def __getitem__(self, i: slice) -> list[Part]: ...
    def __getitem__(self, i: int | slice) -> Part | list[Part]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        n = len(self._spans.offset)
        if i >= n:
            return self._hidden[i - n]
        start = int(self._spans.offset[i])
        return self._flat[int(self._spans.plane[i])][start:start + self.sizes[i]]

    def __iter__(self) -> Iterator[Part]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def gather(self, first: int, count: int, slot: torch.Tensor) -> bool:
        """Copy pieces `[first, first + count)` into `slot`, back to back, in one launch on the current stream.
        False, having copied nothing, where the kernel cannot do it (the caller copies the views)."""
        return self._launch(first, count, slot, to_slot=True)

    def scatter(self, slot: torch.Tensor, first: int, count: int) -> bool:
        """The reverse of `gather`: the pieces `[first, first + count)` from `slot`, back to back."""
        return self._launch(first, count, slot, to_slot=False)

    def _launch(self, first: int, count: int, slot: torch.Tensor, to_slot: bool) -> bool:
        if first + count > self._reach or slot.device != self.device or not row_copy.kernels_usable(self.device):
            return False
        assert 0 <= first and first + count <= len(self) and slot.numel() >= sum(self.sizes[first:first + count])
        table = self._upload()
        wide = self._wide and slot.data_ptr() % 8 == 0
        return _run(table, first, count, max(self.sizes[first:first + count], default=0), slot, to_slot, wide)

    def _upload(self) -> tuple[torch.Tensor, ...]:
        """The table on the device, once: each piece's address, bytes and position in the stream."""
        if self._table is None:
            nbytes = torch.tensor(self.sizes, dtype=torch.int64)
            position = torch.cumsum(nbytes, 0) - nbytes  # [pieces] bytes before each
            reach = slice(0, self._reach)  # 8-byte words where every piece the kernel may copy allows them
            self._wide = bool(((self._address[reach] % 8 == 0) & (nbytes[reach] % 8 == 0)).all())
            self._table, self._pinned = _table(self._address, nbytes, position, self.device)
        return self._table


def warm(device: torch.device) -> bool:
    """Compile the pack kernel's four variants (to and from a slot, bytes and words) for `device`, copying a few
    bytes there, so that no pull pays Triton's compile (a second or so); whether it can run."""
    if not row_copy.kernels_usable(device):
        return False
    piece, slot = torch.arange(16, dtype=torch.uint8, device=device), torch.zeros(16, dtype=torch.uint8, device=device)
    one = torch.tensor([piece.data_ptr()]), torch.tensor([16]), torch.tensor([0])
    table, _ = _table(*one, device)
    ok = all(_run(table, 0, 1, 16, slot, to_slot, wide) for to_slot in (True, False) for wide in (True, False))
    return ok and bool(torch.equal(piece, slot))


def _table(address: torch.Tensor, nbytes: torch.Tensor, position: torch.Tensor,
           device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The three columns on `device` (uploaded on the current stream, before any launch on it reads them), each
    starting 16-byte aligned whatever the count (Triton compiles a variant per pointer alignment); and the host
    copy, to be kept until the upload is surely done."""
    n = len(address)
    m = n + n % 2
    host = torch.zeros(3, m, dtype=torch.int64)  # [3, pieces rounded up to even]
    host[0, :n], host[1, :n], host[2, :n] = address, nbytes, position
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    return (on_device[0], on_device[1], on_device[2]), host


def _run(table: tuple[torch.Tensor, ...], first: int, count: int, largest: int, slot: torch.Tensor, to_slot: bool,
         wide: bool) -> bool:
    """Launch the kernel for pieces `[first, first + count)` (the largest `largest` bytes) on the current stream;
    False where it cannot be built here (logged once, never tried again in this process)."""
    chunks = -(-largest // ((8 if wide else 1) * WORDS_PER_PROGRAM))
    if not count or not chunks:
        return True
    try:
        with row_copy.on_device(slot.device):
            _copy_pieces[(count, chunks)](*table, first, slot.data_ptr(), TO_SLOT=to_slot, WIDE=wide,
                                          BLOCK=WORDS_PER_PROGRAM)
    except Exception as exc:  # Triton's compile and launch errors have no common base; any means "not here"
        row_copy.broken(exc)
        return False
    return True
