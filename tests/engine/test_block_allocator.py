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


def test_named_blocks_are_shared_counted_and_evicted_last_used_first() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    alloc.name(a[0], b"p0")
    alloc.name(a[1], b"p1")
    assert alloc.share([b"p0", b"p1", b"p2"]) == a  # the longest run from the start
    assert alloc.share([b"p1"]) == [a[1]]
    alloc.free(a)
    alloc.free(a)
    assert alloc.num_free == 3  # two free, a[0] idle; a[1] still has a user
    alloc.free([a[1]])
    assert (alloc.num_free, alloc.num_cached) == (4, 2)  # idle: free to take, still findable
    assert alloc.share([b"p0"]) == [a[0]] and alloc.num_free == 3  # in use again
    alloc.free([a[0]])
    assert alloc.allocate(3) == [2, 3, a[1]]  # free ones first, then the idle one used least recently
    assert alloc.share([b"p1"]) == [] and alloc.share([b"p0"]) == [a[0]]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


def test_a_name_stays_with_its_first_block_and_unnamed_blocks_go_back_free() -> None:
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(1), alloc.allocate(1)
    alloc.name(a[0], b"p")
    alloc.name(b[0], b"p")  # the same prefix computed twice: the first copy is the cached one
    alloc.free(a + b)
    assert alloc.num_cached == 1 and alloc.share([b"p"]) == a
    with pytest.raises(ValueError, match="not allocated"):
        alloc.name(b[0], b"q")
