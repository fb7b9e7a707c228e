"""connectors/transports/row_copy.py: one kernel copies every plane's blocks, by address, where Triton runs.

On the CPU the kernel runs in Triton's interpreter (a child process with TRITON_INTERPRET=1, where Triton is
installed: torch's CPU build does not bring it); on a GPU (`-m gpu`) for real, through `copy_blocks`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvwire.connectors.transports import row_copy
from kvwire.connectors.transports.block_copy import copy_blocks
from kvwire.connectors.transports.kv_region import plan_runs
from tests.connectors.transports.test_block_copy import _region

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

INTERPRETED = textwrap.dedent("""
    import torch
    from kvwire.connectors.transports import row_copy as rc
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 255, (10, 64), dtype=torch.uint8, generator=gen) for _ in range(4)]  # [blocks, row]
    dst = [torch.zeros(12, 64, dtype=torch.uint8) for _ in range(4)]
    assert rc.usable(dst, src) and rc.copy_rows(dst, src, [3, 7, 1], [0, 11, 5]), rc._broken
    for s, d in zip(src, dst):
        assert torch.equal(d[0], s[3]) and torch.equal(d[11], s[7]) and torch.equal(d[5], s[1])
        assert int(d[[1, 2, 3, 4, 6, 7, 8, 9, 10]].sum()) == 0  # no other block written
    big = torch.randint(0, 255, (10, 2, 13), dtype=torch.uint8, generator=gen)  # K and V interleaved, odd rows
    src, dst = [big[:, 0], big[:, 1]], [torch.zeros(4, 13, dtype=torch.uint8) for _ in range(2)]
    assert rc.usable(dst, src) and rc.copy_rows(dst, src, [9, 2], [1, 3])
    assert torch.equal(dst[0][1], big[9, 0]) and torch.equal(dst[1][3], big[2, 1])
    table = rc.RowTable(dst, src)  # built once, then copy after copy with only the block indices
    assert table.copy([0], [0]) and table.copy([5, 6], [2, 1]) and table.copy([], [])
    assert torch.equal(dst[0][0], big[0, 0]) and torch.equal(dst[1][2], big[5, 1]) and torch.equal(dst[0][1], big[6, 0])
    print("ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (torch's CPU build lacks it; GPU installs have it)")
def test_the_kernel_copies_exactly_the_named_blocks_of_every_plane_in_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_block_indices_outside_either_side_are_refused_before_any_launch():
    src, dst = [torch.zeros(4, 8, dtype=torch.uint8)], [torch.zeros(6, 8, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="source block 4 outside planes of 4 blocks"):
        row_copy.copy_rows(dst, src, [4], [0])
    with pytest.raises(ValueError, match="destination block 6 outside planes of 6 blocks"):
        row_copy.copy_rows(dst, src, [0], [6])
    with pytest.raises(ValueError, match="cannot be copied into rows of 16"):
        row_copy.copy_rows([torch.zeros(6, 16, dtype=torch.uint8)], src, [0], [0])


def test_host_planes_and_strided_rows_take_block_copys_path():
    host = [torch.zeros(4, 8, dtype=torch.uint8)]
    assert not row_copy.usable(host, host) or os.environ.get("TRITON_INTERPRET") == "1"
    strided = [torch.zeros(4, 8, 2, dtype=torch.uint8)[:, :, 0]]  # a head slice's rows: not contiguous
    assert not row_copy.usable(strided, strided)


@pytest.mark.parametrize("pool", ["kvwire", "vllm"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_copy_blocks_is_one_kernel_and_lands_every_byte(pool):
    from torch.profiler import ProfilerActivity, profile

    from kvwire.connectors.wire import PoolLayout

    assert row_copy.warm(torch.device("cuda")), row_copy._broken  # Triton builds and runs it on this machine
    layout = PoolLayout(pool)
    src, dst = _region(layout, "cuda", seed=1), _region(layout, "cuda", seed=2)
    expected = [p.clone() for p in dst.planes]
    src_blocks, dst_blocks = [5, 1, 2, 3, 17], [0, 9, 10, 11, 4]
    for s, d in zip(src.planes, expected):
        d[dst_blocks] = s[src_blocks]
    runs = plan_runs(src_blocks, dst_blocks)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        copy_blocks(dst.planes, src.planes, runs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and "copy_rows" in e.key]
    assert sum(e.count for e in kernels) == 1, [e.key for e in prof.key_averages()]
    assert all(torch.equal(a, b) for a, b in zip(dst.planes, expected))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_mapping_builds_its_table_once_and_every_pull_lands():
    """A consumer's pulls from one producer mapping (shm/peer.py's MappedPlanes, as CUDA IPC opens them) reuse
    the row kernel's table: one per mapping and destination, every pull's bytes right."""
    from kvwire.connectors.transports.shm.copier import BlockCopier
    from kvwire.connectors.transports.shm.peer import MappedPlanes
    from kvwire.connectors.wire import PoolLayout, ShmAccess

    layout = PoolLayout("vllm")
    src, dst = _region(layout, "cuda", seed=1), _region(layout, "cuda", seed=2)
    mapping = MappedPlanes(ShmAccess.CUDA_IPC, tuple(src.planes), BlockCopier(1))
    tables = []
    for src_blocks, dst_blocks in (([5, 1, 2], [0, 9, 10]), ([17, 3], [4, 11])):
        expected = [p.clone() for p in dst.planes]
        for s, d in zip(src.planes, expected):
            d[dst_blocks] = s[src_blocks]
        mapping.copy(dst, src.layout, None, plan_runs(src_blocks, dst_blocks))
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(dst.planes, expected))
        tables.append(mapping._rows[1])
    assert tables[0] is not None and tables[0] is tables[1], "the table was built once"
