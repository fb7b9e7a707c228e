"""connectors/transports/piece_copy.py and `KVRegion.spans`: a pull's pieces by address, a pack in one kernel.

`spans` must cut exactly the pieces `parts`/`layer_major_parts` cut (the two sides of a UCX pull plan their
messages from them); `DevicePieces` gives the same views and sizes; its kernel runs here in Triton's
interpreter (a child process with TRITON_INTERPRET=1, where Triton is installed), on a GPU in
tests/gpu/test_device_packing_gpu.py. Without the kernel, packing falls back to the views, byte for byte.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvwire.connectors.transports import piece_copy, row_copy
from kvwire.connectors.transports.kv_region import KVRegion, Part
from kvwire.connectors.transports.piece_copy import DevicePieces
from kvwire.connectors.transports.ucx.packing import DEVICE_PACK_BELOW, gather, plan_messages, scatter
from kvwire.connectors.wire import PoolLayout
from tests.connectors.transports.test_block_copy import NUM_BLOCKS, _region

HAS_TRITON = importlib.util.find_spec("triton") is not None
RUNS = [(3, 2), (9, 1), (0, 4), (NUM_BLOCKS - 1, 1)]


def _address(part: Part) -> tuple[int, int]:
    if isinstance(part, memoryview):
        return torch.frombuffer(part, dtype=torch.uint8).data_ptr() if part.nbytes else 0, part.nbytes
    return part.data_ptr(), part.numel()


def _span_addresses(region: KVRegion, layer_major: bool) -> list[tuple[int, int]]:
    spans = region.spans(RUNS, layer_major)
    bases = [p.data_ptr() for p in region.planes]
    return [(bases[p] + o, n) for p, o, n in zip(spans.plane.tolist(), spans.offset.tolist(), spans.nbytes.tolist())]


@pytest.mark.parametrize("layer_major", [False, True], ids=["plane-major", "layer-major"])
@pytest.mark.parametrize("heads", [None, (1, 1)], ids=["whole-rows", "head-slice"])
@pytest.mark.parametrize("pool", list(PoolLayout), ids=str)
def test_spans_cut_exactly_the_pieces_parts_cuts_in_every_layout(pool, heads, layer_major):
    region = _region(pool)
    if heads is not None:
        if pool not in (PoolLayout.VLLM_CPU, PoolLayout.VLLM_HNC):
            pytest.skip("heads are not byte ranges of a row in this layout")
        region = region.heads(*heads)
    parts = region.layer_major_parts(RUNS) if layer_major else region.parts(RUNS)
    assert _span_addresses(region, layer_major) == [_address(p) for p in parts]


def test_runs_outside_the_planes_are_refused():
    region = _region(PoolLayout.VLLM)
    with pytest.raises(ValueError, match="outside planes"):
        region.spans([(NUM_BLOCKS - 1, 2)])
    with pytest.raises(ValueError, match="outside planes"):
        region.spans([(-1, 1)])
    assert region.spans([]).offset.numel() == 0


def test_device_pieces_are_the_parts_views_then_the_hidden_states():
    region = _region(PoolLayout.VLLM_HNC)
    hidden = [torch.arange(10, dtype=torch.float16)]
    pieces = DevicePieces(region, region.spans(RUNS), hidden)
    parts = region.parts(RUNS)
    assert len(pieces) == len(parts) + 1 and pieces.sizes == [p.nbytes for p in parts] + [20]
    assert [_address(p) for p in pieces][:-1] == [_address(p) for p in parts]
    assert _address(pieces[-1]) == (hidden[0].data_ptr(), 20)
    assert [_address(p) for p in pieces[2:4]] == [_address(p) for p in parts[2:4]]
    assert pieces.nbytes == sum(pieces.sizes)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the kernel serves under the interpreter")
def test_without_the_kernel_packs_go_through_the_views_byte_for_byte():
    """Where the kernel cannot run (here: a CPU pool, no interpreter) `gather`/`scatter` copy the views."""
    src, dst = _region(PoolLayout.VLLM, seed=1), _region(PoolLayout.VLLM, seed=2)
    dst_runs = [(10, 2), (0, 1), (4, 4), (15, 1)]
    sent, landing = DevicePieces(src, src.spans(RUNS)), DevicePieces(dst, dst.spans(dst_runs))
    assert not sent.gather(0, 2, torch.empty(1 << 20, dtype=torch.uint8))
    slot = torch.empty(1 << 20, dtype=torch.uint8)
    for msg in plan_messages(sent.sizes, DEVICE_PACK_BELOW):
        scatter(gather(sent, msg, slot), landing, msg)
    for (s, _), (d, _) in zip(RUNS, dst_runs):
        assert all(torch.equal(sp[s], dp[d]) for sp, dp in zip(src.planes, dst.planes))
    assert not row_copy.missing_on(torch.device("cpu"))  # a CPU pool never counts the kernel missing


INTERPRETED = textwrap.dedent("""
    import torch
    from kvwire.connectors.transports.piece_copy import DevicePieces
    from kvwire.connectors.transports.ucx.packing import DEVICE_PACK_BELOW, gather, plan_messages, scatter
    from tests.connectors.transports.test_block_copy import _region
    from kvwire.connectors.wire import PoolLayout

    for pool, heads in ((PoolLayout.VLLM, None), (PoolLayout.VLLM_HNC, (1, 1)), (PoolLayout.KVWIRE, None)):
        src, dst = _region(pool, seed=1), _region(pool, seed=2)
        if heads:
            src, dst = src.heads(*heads), dst.heads(*heads)
        src_runs, dst_runs = [(3, 2), (9, 1), (0, 1)], [(10, 2), (0, 1), (15, 1)]
        for layer_major, n in ((False, 7), (True, 16)):  # 7 hidden bytes: byte-wise copies; 16: 8-byte words
            hidden = [torch.arange(n, dtype=torch.uint8)], [torch.zeros(n, dtype=torch.uint8)]
            sent = DevicePieces(src, src.spans(src_runs, layer_major), hidden[0])
            landing = DevicePieces(dst, dst.spans(dst_runs, layer_major), hidden[1])
            assert sent._upload() and sent._wide == (n % 8 == 0)
            slot = torch.full((1 << 20,), 255, dtype=torch.uint8)
            msgs = plan_messages(sent.sizes, DEVICE_PACK_BELOW)
            for msg in msgs:
                assert sent.gather(msg.first, msg.count, slot)
                assert torch.equal(slot[:msg.nbytes], torch.cat([torch.as_tensor(p) if isinstance(p, torch.Tensor)
                                   else torch.frombuffer(p, dtype=torch.uint8) for p in sent[msg.first:msg.first
                                   + msg.count]]))
                assert landing.scatter(slot, msg.first, msg.count)
            for s, d in zip(sent, landing):
                a = s if isinstance(s, torch.Tensor) else torch.frombuffer(s, dtype=torch.uint8)
                b = d if isinstance(d, torch.Tensor) else torch.frombuffer(d, dtype=torch.uint8)
                assert torch.equal(a, b)
        untouched = [b for b in range(dst.num_blocks) if b not in (10, 11, 0, 15)]
        before = _region(pool, seed=2)
        assert all(torch.equal(p[untouched], q[untouched]) for p, q in zip(dst.planes, before.planes))
    from kvwire.connectors.transports import piece_copy
    assert piece_copy.warm(torch.device("cpu"))  # its four variants
    print("ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (torch's CPU build "
                    "lacks it; GPU installs have it)")
def test_the_pack_kernel_gathers_and_scatters_every_layout_in_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_gpu_pool_without_the_kernel_is_counted_as_a_fallback(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(row_copy, "_broken", ["RuntimeError: no C compiler"])
    assert row_copy.missing_on(gpu) and not row_copy.kernels_usable(gpu)
    monkeypatch.setattr(row_copy, "_broken", [])
    monkeypatch.setattr(row_copy, "triton", None)
    assert row_copy.missing_on(gpu)


def test_a_message_plan_from_device_pieces_equals_the_one_from_views():
    region = _region(PoolLayout.VLLM)
    assert plan_messages(DevicePieces(region, region.spans(RUNS)).sizes, DEVICE_PACK_BELOW) == plan_messages(
        [p.nbytes for p in region.parts(RUNS)], DEVICE_PACK_BELOW)


def test_warming_on_the_cpu_does_nothing_and_says_so():
    assert piece_copy.warm(torch.device("cpu")) == (os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool", [PoolLayout.VLLM, PoolLayout.VLLM_HNC, PoolLayout.KVWIRE], ids=str)
def test_on_a_gpu_a_pack_is_one_kernel_each_way_and_lands_every_byte(pool):
    assert piece_copy.warm(torch.device("cuda")), row_copy._broken  # Triton builds and runs it on this machine
    src, dst = _region(pool, "cuda", seed=1), _region(pool, "cuda", seed=2)
    before = [p.clone() for p in dst.planes]
    src_runs, dst_runs = [(3, 2), (9, 1), (0, 1)], [(10, 2), (0, 1), (15, 1)]
    for layer_major in (False, True):
        sent = DevicePieces(src, src.spans(src_runs, layer_major), [torch.arange(8, dtype=torch.uint8, device="cuda")])
        landing = DevicePieces(dst, dst.spans(dst_runs, layer_major), [torch.zeros(8, dtype=torch.uint8,
                                                                                    device="cuda")])
        slot = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        for msg in plan_messages(sent.sizes, DEVICE_PACK_BELOW):
            assert sent.gather(msg.first, msg.count, slot) and landing.scatter(slot, msg.first, msg.count)
        torch.cuda.synchronize()
        assert all(torch.equal(s, d) for s, d in zip(sent, landing))
    untouched = [b for b in range(NUM_BLOCKS) if b not in (10, 11, 0, 15)]
    assert all(torch.equal(p[untouched], q[untouched]) for p, q in zip(dst.planes, before))
    on_host = DevicePieces(src, src.spans(src_runs), [torch.arange(8, dtype=torch.uint8)])  # hidden on the CPU
    kv = len(on_host) - 1
    slot = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert on_host.gather(0, kv, slot) and not on_host.gather(kv - 1, 2, slot)  # that pack: the views' copy
