"""The hold board: one word per held request, in shared memory, that says its blocks are still held.

It lets a same-host consumer read a request's blocks with no round trip to the producer:

1. Publish (producer, engine thread): `mark` takes a free slot and writes a fresh token (never
   0, never reused in this incarnation) into it; the location carries (slot, token) as its
   `ShmHold`, and the direct word carries the hidden states.
2. Read (consumer): the word must be the token before the copy starts and still be it after
   the copy ends (CUDA: synchronized). Then no byte it copied was reused meanwhile, because
3. Release (producer, whichever thread releases): `unmark` zeroes the word *before* the
   blocks go back to the engine's allocator (HeldTable's `before_release`), so any write to
   a reused block comes after the zero in this process's store order; x86's loads are not
   reordered with older loads, so a consumer that reads the token after its copy read no
   byte written after the zero. A read that fails the check is discarded (the consumer
   falls back to a claim, which is refused for a released request: it recomputes).
4. `close()` closes the descriptors; the memory goes with the last process mapping it.

A full board (more requests held than slots) marks nothing: those requests are read after a
claim, as before. The consumer maps the board read-only from the descriptor that follows
the pool's in `ShmSegment` (`hold_slots` words of 8 bytes).
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import platform
import threading

from kvwire.connectors.shm.channel import node_prefix
from kvwire.connectors.wire import ShmHold

WORD = 8  # bytes per word: int64, aligned, stored and loaded whole
# The check after the copy relies on loads not passing older loads (x86's order); elsewhere reads claim first.
ORDERED_LOADS = platform.machine().lower() in {"x86_64", "amd64"}
_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class HoldBoard:
    """The producer's side: thread-safe."""

    def __init__(self, producer: str, epoch: int, slots: int):
        """Args:
            producer, epoch: the node incarnation (names the memfd).
            slots: how many requests can be held with a word at once.
        Raises:
            OSError: the memfd could not be made.
        """
        self.slots = slots
        fd = os.memfd_create(f"kvwire-holds-{node_prefix(producer)}-{epoch}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, slots * WORD)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(fd, slots * WORD)
            self._words = memoryview(self._map).cast("q")
            self.ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
        self._free = list(range(slots - 1, -1, -1))
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def mark(self) -> ShmHold | None:
        """A slot holding a fresh token, or None when every slot is taken."""
        with self._lock:
            if not self._free:
                return None
            hold = ShmHold(slot=self._free.pop(), token=next(self._tokens))
            self._words[hold.slot] = hold.token
        return hold

    def unmark(self, hold: ShmHold) -> None:
        """The request's blocks are about to be released: readers from now on discard what they read."""
        with self._lock:
            assert self._words[hold.slot] == hold.token, "a hold word unmarked twice"
            self._words[hold.slot] = 0
            self._free.append(hold.slot)

    def close(self) -> None:
        if self.ro_fd >= 0:
            os.close(self.ro_fd)
            self.ro_fd = -1


def map_board(slots: int, fd: int) -> memoryview:
    """Consumer: a producer's board, read-only, as `slots` int64 words.

    Raises:
        ValueError: the memfd is smaller than announced or could still shrink.
    """
    nbytes = slots * WORD
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
        raise ValueError("the hold board's memfd is not sealed against shrinking")
    if slots <= 0 or os.fstat(fd).st_size < nbytes:
        raise ValueError(f"the hold board's memfd holds {os.fstat(fd).st_size} bytes, not {nbytes}")
    return memoryview(mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)).cast("q")


def still_held(board: memoryview, hold: ShmHold) -> bool:
    """Whether the producer still holds the blocks `hold` marks (consumer; a slot out of range: no)."""
    return 0 <= hold.slot < len(board) and board[hold.slot] == hold.token
