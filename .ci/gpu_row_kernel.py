"""The row kernel (connectors/transports/row_copy.py) alone on a GPU, one process.

Its time by BLOCK and num_warps, against `copy_blocks` (kernel and its table built in Python) and the per-plane
gather, for 64 vLLM-layout planes (32 layers' K and V) of 4,096 blocks of 32 KiB: 16 GiB of device memory.
Run on the GPU machine once `.ci/gpu run` has installed its venv:
`/tmp/kvwire-gpu/venv/bin/python .ci/gpu_row_kernel.py` (docs/BENCHMARKS.md, issue 45's H200 section).
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable

import torch
import triton

from kvwire.connectors.transports import row_copy
from kvwire.connectors.transports.block_copy import copy_blocks
from kvwire.connectors.transports.kv_region import plan_runs

POOL_BLOCKS, ROW = 4096, 32768  # a block of one layer's K (or V): 16 tokens x 8 heads x 128 x bf16


def timed(fn: Callable[[], object], n: int = 20) -> float:
    """Median seconds of `fn` to the device's end."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def measure(tokens: int, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    dev = src[0].device
    n = tokens // 16
    src_blocks = random.Random(1).sample(range(POOL_BLOCKS), n)
    dst_blocks = random.Random(2).sample(range(POOL_BLOCKS), n)
    nbytes = n * ROW * len(src)

    def line(what: str, seconds: float) -> None:
        print(f"{tokens:6d} tok {nbytes >> 20:5d} MiB  {what:34s} {seconds * 1e3:7.3f} ms "
              f"{nbytes / seconds / 1e9:7.1f} GB/s")

    line("copy_blocks (kernel and table)", timed(functools.partial(copy_blocks, dst, src,
                                                                   plan_runs(src_blocks, dst_blocks))))
    si, di = torch.tensor(src_blocks, device=dev), torch.tensor(dst_blocks, device=dev)

    def gather() -> None:
        for d, s in zip(dst, src):
            d.index_copy_(0, di, s.index_select(0, si))

    line("per-plane gather (limit-gather)", timed(gather))
    table = torch.tensor([v for s, d in zip(src, dst)
                          for v in (s.data_ptr(), s.stride(0), d.data_ptr(), d.stride(0), ROW // 8)], device=dev)
    for block in (512, 1024, 2048, 4096):
        for warps in (4, 8, 16):
            kernel = row_copy._copy_rows[(len(src) * n, triton.cdiv(ROW // 8, block))]
            line(f"kernel BLOCK={block} warps={warps}",
                 timed(functools.partial(kernel, table, si, di, n, WIDE=True, BLOCK=block, num_warps=warps)))
    print("verified", all(torch.equal(d[dst_blocks], s[src_blocks]) for d, s in zip(dst, src)),
          "kernel broken:", row_copy._broken)


def main() -> None:
    dev = torch.device("cuda")
    layers = [torch.randint(0, 255, (2, POOL_BLOCKS, ROW), dtype=torch.uint8, device=dev) for _ in range(32)]
    dst_layers = [torch.zeros(2, POOL_BLOCKS, ROW, dtype=torch.uint8, device=dev) for _ in range(32)]
    src = [layer[half] for layer in layers for half in (0, 1)]  # each [blocks, row]
    dst = [layer[half] for layer in dst_layers for half in (0, 1)]
    for tokens in (128, 2048, 16384):
        measure(tokens, src, dst)


if __name__ == "__main__":
    main()
