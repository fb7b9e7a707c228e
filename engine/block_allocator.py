"""Hands out KV blocks; prefers contiguous runs so transfers can move them as one piece."""

from __future__ import annotations

import threading


class OutOfBlocks(RuntimeError):
    def __init__(self, wanted: int, free: int):
        super().__init__(f"wanted {wanted} KV blocks, {free} free")
        self.wanted = wanted
        self.free = free


class BlockAllocator:
    """Free-list allocator over block ids `0 .. num_blocks-1`. Thread-safe.

    Allocation takes the lowest free ids in order, so a fresh or quiet pool hands out
    one contiguous run; freeing returns ids to the free set.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks. Raises OutOfBlocks when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(n, len(self._free))
            ids = sorted(self._free)[:n]
            self._free.difference_update(ids)
            return ids

    def free(self, block_ids: list[int]) -> None:
        """Return blocks. Raises ValueError on a double free or a foreign id."""
        with self._lock:
            bad = [b for b in block_ids if b in self._free or not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(f"freeing blocks that are not allocated: {bad[:8]}")
            self._free.update(block_ids)
