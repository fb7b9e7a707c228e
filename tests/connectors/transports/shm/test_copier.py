"""connectors/transports/shm/copier.py: one pull's block copies split over several threads."""

from __future__ import annotations

import random

import pytest
import torch

from kvwire.connectors.transports.kv_region import plan_runs
from kvwire.connectors.transports.shm.copier import BlockCopier, split_runs


@pytest.mark.parametrize("lanes", [1, 2, 3])
@pytest.mark.parametrize("contiguous", [False, True])
def test_every_block_lands_once_where_it_belongs(lanes, contiguous):
    rng = random.Random(lanes)
    src_ids = list(range(5, 45)) if contiguous else rng.sample(range(64), 40)
    dst_ids = list(range(10, 50)) if contiguous else rng.sample(range(64), 40)
    runs = plan_runs(src_ids, dst_ids)
    shares = split_runs(runs, lanes)
    assert len(shares) == lanes
    moved = sorted((s + k, d + k) for share in shares for s, d, n in share for k in range(n))
    assert moved == sorted(zip(src_ids, dst_ids))
    if contiguous and lanes > 1:
        assert all(shares), "one long run is cut so that every lane has work"

    src = torch.randint(0, 255, (64, 4096), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copier = BlockCopier(lanes, min_parallel_bytes=0)
    try:
        copier.copy([dst], [src], runs)
    finally:
        copier.close()
    assert torch.equal(dst[dst_ids], src[src_ids])
    untouched = sorted(set(range(64)) - set(dst_ids))
    assert not dst[untouched].any()


def test_a_lane_that_fails_fails_the_copy_after_every_lane_stopped():
    src = torch.zeros(8, 16, dtype=torch.uint8)
    dst = torch.zeros(8, 32, dtype=torch.uint8)  # rows of another size: every copy_ raises
    copier = BlockCopier(2, min_parallel_bytes=0)
    try:
        with pytest.raises(RuntimeError):
            copier.copy([dst], [src], [(0, 0, 1), (2, 2, 1), (4, 4, 1)])
    finally:
        copier.close()


def test_small_pulls_stay_on_the_calling_thread(monkeypatch):
    import threading

    import kvwire.connectors.transports.shm.copier as copier_module

    threads = set()
    original = copier_module._copy

    def spying(d, s, runs):
        threads.add(threading.current_thread().name)
        original(d, s, runs)

    monkeypatch.setattr(copier_module, "_copy", spying)
    src, dst = torch.ones(8, 16, dtype=torch.uint8), torch.zeros(8, 16, dtype=torch.uint8)
    for min_bytes, want_threads in ((1 << 20, 1), (0, 2)):  # 128 bytes: below, then above the threshold
        threads.clear()
        dst.zero_()
        copier = BlockCopier(2, min_parallel_bytes=min_bytes)
        try:
            copier.copy([dst], [src], [(0, 0, 8)])
        finally:
            copier.close()
        assert len(threads) == want_threads and threading.current_thread().name in threads
        assert dst.all()
