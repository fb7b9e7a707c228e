"""BlockAllocator: counts, contiguity, double frees, exhaustion."""

from __future__ import annotations

import pytest

from kvwire.engine.block_allocator import BlockAllocator, OutOfBlocks


def test_allocate_and_free_return_to_start() -> None:
    alloc = BlockAllocator(10)
    a, b = alloc.allocate(3), alloc.allocate(4)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6]  # a fresh pool hands out contiguous runs
    assert alloc.num_free == 3
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 10
    assert alloc.allocate(10) == list(range(10))


def test_double_free_and_foreign_ids_raise() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    alloc.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(ids)
    with pytest.raises(ValueError):
        alloc.free([99])
    assert alloc.num_free == 4


def test_out_of_blocks() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks) as err:
        alloc.allocate(2)
    assert (err.value.wanted, err.value.free) == (2, 1)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    with pytest.raises(ValueError):
        BlockAllocator(0)
