"""The hold board: one word per held request, in shared memory, that says its blocks are still held.

It lets a same-host consumer read a request's blocks and hidden states with no round trip to
the producer:

1. Publish (producer, engine thread): `mark` takes a free slot and writes a fresh token (never
   0, never reused in this incarnation) into it, and copies the request's hidden states into
   the board's hidden area when they fit; the location carries (slot, token, where the hidden
   states lie) as its `ShmHold`. The KVReady also carries small hidden states, so they are
   tensors before the pull starts.
2. Read (consumer): the word must be the token before the copy starts and still be it after
   the copy (of blocks and hidden states) ends (CUDA: synchronized). Then no byte it copied
   was reused meanwhile, because
3. Release (producer, whichever thread releases): `unmark` zeroes the word *before* the
   blocks go back to the engine's allocator (HeldTable's `before_release`) and before its
   range of the hidden area is free again, so any write to a reused block or range comes
   after the zero in this process's store order; x86's loads are not reordered with older
   loads, so a consumer that reads the token after its copy read no byte written after the
   zero. A read that fails the check is discarded (the consumer falls back to a claim,
   which is refused for a released request: it recomputes).
4. `close()` closes the descriptors; the memory goes with the last process mapping it.

A full board (more requests held than slots) marks nothing: those requests are read after a
claim, as before; so are those whose hidden states find no room in the area (the location
says so with `hidden_at` = -1) unless the KVReady carries them. The consumer maps the
board read-only from the descriptor that follows the pool's in `ShmSegment`: `hold_slots`
words of 8 bytes, then from the next page on `hold_hidden_bytes` of hidden area. The area is
sparse: a page takes memory once a request's hidden states were written to it.
"""

from __future__ import annotations

import bisect
import fcntl
import itertools
import mmap
import os
import platform
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvwire.connectors.hidden import fill_tensors, host_bytes
from kvwire.connectors.transports.shm.channel import node_prefix
from kvwire.connectors.wire import ShmHold

WORD = 8  # bytes per word: int64, aligned, stored and loaded whole
PAGE = mmap.PAGESIZE  # the hidden area starts on a page and is handed out in pages
HIDDEN_AREA = 64 << 20  # bytes of hidden area by default: 8,192 requests' Llama-3-8B hidden rows (8 KiB, 2 pages)
# The check after the copy relies on loads not passing older loads (x86's order); elsewhere reads claim first.
ORDERED_LOADS = platform.machine().lower() in {"x86_64", "amd64"}
_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def area_offset(slots: int) -> int:
    """Where the hidden area begins: the first page after the words."""
    return -(-slots * WORD // PAGE) * PAGE


class HoldBoard:
    """The producer's side: thread-safe."""

    def __init__(self, producer: str, epoch: int, slots: int, hidden_bytes: int = HIDDEN_AREA):
        """Args:
            producer, epoch: the node incarnation (names the memfd).
            slots: how many requests can be held with a word at once.
            hidden_bytes: the hidden area's size (whole pages; 0: none).
        Raises:
            OSError: the memfd could not be made.
        """
        self.slots = slots
        self.hidden_bytes = hidden_bytes // PAGE * PAGE
        size = area_offset(slots) + self.hidden_bytes
        fd = os.memfd_create(f"kvwire-holds-{node_prefix(producer)}-{epoch}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(fd, size)
            self._words = memoryview(self._map)[:slots * WORD].cast("q")
            self._area = memoryview(self._map)[area_offset(slots):]
            self.ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
        self._free = list(range(slots - 1, -1, -1))
        self._pages = _Pages(self.hidden_bytes // PAGE)
        self._spans: dict[int, tuple[int, int]] = {}  # slot -> its hidden states' (first page, pages)
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def mark(self, hidden: Sequence[torch.Tensor] = ()) -> ShmHold | None:
        """A slot holding a fresh token, or None when every slot is taken; `hidden` (contiguous) is copied into
        the area when it has room (the hold's `hidden_at` says where; -1: no room, or no bytes)."""
        data = host_bytes(list(hidden)) if hidden else memoryview(b"")
        pages = -(-len(data) // PAGE)
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            first = self._pages.take(pages) if pages else None
            if first is not None:
                self._spans[slot] = (first, pages)
            hold = ShmHold(slot=slot, token=next(self._tokens), hidden_at=-1 if first is None else first * PAGE)
        if first is not None:  # the slot and its pages are ours alone until `unmark`: no lock for the copy
            self._area[hold.hidden_at:hold.hidden_at + len(data)] = data
        self._words[slot] = hold.token
        return hold

    def unmark(self, hold: ShmHold) -> None:
        """The request's blocks are about to be released: readers from now on discard what they read."""
        with self._lock:
            assert self._words[hold.slot] == hold.token, "a hold word unmarked twice"
            self._words[hold.slot] = 0
            span = self._spans.pop(hold.slot, None)
            if span is not None:  # after the zero: a reader that saw the token read none of its next bytes
                self._pages.give(*span)
            self._free.append(hold.slot)

    def close(self) -> None:
        if self.ro_fd >= 0:
            os.close(self.ro_fd)
            self.ro_fd = -1


class _Pages:
    """First-fit runs of pages: (first, count) free runs, sorted and merged."""

    def __init__(self, pages: int):
        self._runs: list[tuple[int, int]] = [(0, pages)] if pages else []

    def take(self, n: int) -> int | None:
        for i, (first, count) in enumerate(self._runs):
            if count >= n:
                self._runs[i:i + 1] = [(first + n, count - n)] if count > n else []
                return first
        return None

    def give(self, first: int, n: int) -> None:
        i = bisect.bisect(self._runs, (first, n))
        runs = self._runs
        if i < len(runs) and first + n == runs[i][0]:  # merge with the run after
            n += runs.pop(i)[1]
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == first:  # and the one before
            first, n = runs[i - 1][0], runs[i - 1][1] + n
            i -= 1
            runs.pop(i)
        runs.insert(i, (first, n))


@dataclass(frozen=True)
class BoardView:
    """Consumer: a producer's board, mapped read-only."""

    words: memoryview  # int64, one per slot
    area: memoryview  # the hidden area's bytes

    def still_held(self, hold: ShmHold) -> bool:
        """Whether the producer still holds the blocks `hold` marks (a slot out of range: no)."""
        return 0 <= hold.slot < len(self.words) and self.words[hold.slot] == hold.token

    def has_hidden(self, hold: ShmHold, nbytes: int) -> bool:
        """Whether `nbytes` of hidden states lie in the area for `hold`."""
        return hold.hidden_at >= 0 and hold.hidden_at + nbytes <= len(self.area)

    def read_hidden(self, hold: ShmHold, tensors: list[torch.Tensor]) -> int:
        """Copy `hold`'s hidden states into `tensors` (contiguous, any device); valid only if the word still
        holds the token afterwards. Returns the bytes copied."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return fill_tensors(tensors, self.area[hold.hidden_at:hold.hidden_at + nbytes])


def map_board(slots: int, hidden_bytes: int, fd: int) -> BoardView:
    """Consumer: a producer's board, read-only: `slots` int64 words, then `hidden_bytes` of hidden area.

    Raises:
        ValueError: the memfd is smaller than announced or could still shrink.
    """
    nbytes = area_offset(slots) + hidden_bytes
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
        raise ValueError("the hold board's memfd is not sealed against shrinking")
    if slots <= 0 or hidden_bytes < 0 or os.fstat(fd).st_size < nbytes:
        raise ValueError(f"the hold board's memfd holds {os.fstat(fd).st_size} bytes, not {nbytes}")
    view = memoryview(mmap.mmap(fd, nbytes, prot=mmap.PROT_READ))
    return BoardView(view[:slots * WORD].cast("q"), view[area_offset(slots):])


@runtime_checkable
class ServesHoldBoard(Protocol):
    """A send engine that keeps a hold word per held request (shared memory's): the producer role marks each
    request held or let go on it, for consumers that read with no claim."""

    holds: HoldBoard
