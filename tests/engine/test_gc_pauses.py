"""The start-up heap is frozen out of garbage collection; later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

from kvwire.engine.gc_pauses import freeze_startup_heap


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    kept = [_Node() for _ in range(100)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)  # walked by no collection from now on
        late = _Node()
        ref = weakref.ref(late)
        del late
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
