"""Copy runs of blocks from a producer's mapped planes into the consumer's on several threads at once.

One core's copy does not saturate this kind of machine's memory: two threads copying
disjoint pieces move more bytes per second than one (torch's `copy_` releases the GIL).
Host pools only: a CUDA copy is asynchronous already, and moves every run in a few
launches (transports/block_copy.py).

Lifecycle:

1. `BlockCopier(lanes)` starts lanes - 1 worker threads (none for one lane).
2. `copy` splits the work into chunks, hands every lane its share, copies lane 0's itself
   and returns only once every lane is done, so no thread writes after a pull returns or
   fails.
3. `close` stops the threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvwire.connectors.transports.block_copy import Run, copy_blocks


def split_runs(runs: list[Run], lanes: int) -> list[list[Run]]:
    """Each lane's share of `runs`: runs cut into chunks of at most total / (4 * lanes) blocks, dealt round-robin."""
    total = sum(n for _, _, n in runs)
    step = max(1, total // (4 * lanes))
    chunks = [(s + k, d + k, min(step, n - k)) for s, d, n in runs for k in range(0, n, step)]
    return [chunks[lane::lanes] for lane in range(lanes)]


MIN_PARALLEL_BYTES = 8 << 20  # below this a pull is copied on the calling thread: a hand-off costs more than it saves


class BlockCopier:
    def __init__(self, lanes: int, min_parallel_bytes: int = MIN_PARALLEL_BYTES):
        self.lanes = lanes
        self._min_parallel_bytes = min_parallel_bytes
        self._pool = ThreadPoolExecutor(max_workers=lanes - 1, thread_name_prefix="kv-shm-copy") if lanes > 1 else None

    def copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], runs: list[Run]) -> None:
        """dst[p][d:d+n] = src[p][s:s+n] for every plane p and every (s, d, n) in `runs`; dst, src: matching planes,
        each [num_blocks, row] uint8 (rows may be strided)."""
        nbytes = sum(n for _, _, n in runs) * sum(p.shape[1] for p in dst)
        if dst[0].device.type != "cpu" or not self.parallel(nbytes):
            _copy(dst, src, runs)
            return
        self.run([functools.partial(_copy, dst, src, share) for share in split_runs(runs, self.lanes)])

    def parallel(self, nbytes: int) -> bool:
        """Whether a host copy of `nbytes` is worth splitting over the lanes."""
        return self._pool is not None and nbytes >= self._min_parallel_bytes

    def run(self, shares: Sequence[Callable[[], object]]) -> None:
        """Run each share of a copy, the first on this thread and the rest on the lanes; return once all have ended
        (so no thread writes after a pull returns or fails), raising the first failure."""
        futures = [self._pool.submit(share) for share in shares[1:]] if self._pool is not None else []
        try:
            for share in shares[:1] if self._pool is not None else shares:
                share()
        finally:
            for f in futures:
                f.exception()  # wait for every lane, even after a failure here
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], runs: list[Run]) -> None:
    copy_blocks(dst, src, runs)  # a gather/scatter on a GPU or for many small host runs, else a copy_ per run
