"""Hands out KV blocks; prefers contiguous runs so transfers can move them as one piece; keeps computed prompt
blocks as a prefix cache.

A block's life:

1. `allocate(n)` takes the lowest free ids (a fresh or quiet pool hands out one contiguous run), then, when
   too few are free, the least recently used idle cached blocks, whose names are forgotten.
2. `name(block, name)` (the engine, once the block holds the whole KV of the prefix `name` stands for,
   engine/block_names.py) makes it findable: `share(names)` hands the longest run of a prompt's named blocks to
   another request, each block counted once more.
3. `retain(ids)` counts blocks in use once more (a request's later choice sharing its prompt's blocks,
   engine/shared_prompts.py).
4. `free(ids)` counts each block once less. At zero a named block is idle (still findable, the first taken
   when blocks run out), and an unnamed one is free.

Without `name`, it is a plain free-list allocator (the prefill node's). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    def __init__(self, wanted: int, free: int):
        super().__init__(f"wanted {wanted} KV blocks, {free} free")
        self.wanted = wanted
        self.free = free


class BlockAllocator:
    """Block ids `0 .. num_blocks-1`: free, in use (with a count of users), or idle (cached, unused)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))
        self._users: dict[int, int] = {}  # block in use -> how many requests use it
        self._idle: OrderedDict[int, None] = OrderedDict()  # named blocks nobody uses, least recently used first
        self._block_of: dict[bytes, int] = {}  # name -> block holding that prefix's KV
        self._name_of: dict[int, bytes] = {}
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks holding a named prefix, in use or idle."""
        return len(self._name_of)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks. Raises OutOfBlocks when fewer are free or idle."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n > self.num_free:
                raise OutOfBlocks(n, self.num_free)
            ids = sorted(self._free)[:n]
            self._free.difference_update(ids)
            while len(ids) < n:  # evict the least recently used cached blocks
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._name_of.pop(block)]
                ids.append(block)
            for block in ids:
                self._users[block] = 1
            return ids

    def free(self, block_ids: list[int]) -> None:
        """Give blocks back (one use each). Raises ValueError on a double free or a foreign id."""
        with self._lock:
            bad = [b for b in block_ids if b not in self._users]
            if bad or len(set(block_ids)) != len(block_ids):
                raise ValueError(f"freeing blocks that are not allocated: {(bad or block_ids)[:8]}")
            for block in block_ids:
                self._users[block] -= 1
                if self._users[block]:
                    continue
                del self._users[block]
                if block in self._name_of:
                    self._idle[block] = None
                else:
                    self._free.add(block)

    def retain(self, block_ids: Sequence[int]) -> None:
        """Count blocks in use once more each (free them once more too). Raises ValueError on an id not in use."""
        with self._lock:
            bad = [b for b in block_ids if b not in self._users]
            if bad:
                raise ValueError(f"retaining blocks that are not allocated: {bad[:8]}")
            for block in block_ids:
                self._users[block] += 1

    def share(self, names: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest run of `names` from its start, each now used once more (free them
        with the rest of the request's blocks)."""
        with self._lock:
            blocks = []
            for name in names:
                block = self._block_of.get(name)
                if block is None:
                    break
                blocks.append(block)
            for block in blocks:
                if self._idle.pop(block, 0) is None:  # was idle: in use again
                    self._users[block] = 1
                else:
                    self._users[block] += 1
            return blocks

    def name(self, block: int, name: bytes) -> None:
        """`block` (in use) holds the whole KV of the prefix `name` stands for. A name already held by another
        block, or a block already named, stays as it is."""
        with self._lock:
            if block not in self._users:
                raise ValueError(f"naming block {block}, which is not allocated")
            if name not in self._block_of and block not in self._name_of:
                self._block_of[name] = block
                self._name_of[block] = name
