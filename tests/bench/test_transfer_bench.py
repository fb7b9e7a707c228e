"""`kvwire bench transfer` at a tiny size: every row verified, limits, NIXL and connectors side by side."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from kvwire.bench.choices import Method, Placement
from kvwire.bench.transfer import bench_transfer, combinations
from kvwire.bench.workload import Workload, allocate_pool, piece_table
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import PoolLayout

pytestmark = pytest.mark.slow
KVWIRE, VLLM = PoolLayout.KVWIRE, PoolLayout.VLLM


def test_workload_places_blocks_as_asked():
    scattered, contiguous = Workload(2048, Placement.SCATTERED), Workload(2048, Placement.CONTIGUOUS)
    assert scattered.num_blocks == 128 and scattered.pool_blocks == 256
    assert scattered.block_ids(0) != scattered.block_ids(1) and len(set(scattered.block_ids(1))) == 128
    assert contiguous.block_ids(0) == contiguous.block_ids(1) == list(range(128))
    assert contiguous.runs(0) == contiguous.runs(1) == [(0, 128)]


def test_vllm_pool_moves_64_pieces_per_block_and_kvwire_one_per_run():
    for pool, per_block in ((KVWIRE, 1), (VLLM, 64)):
        work = Workload(48, Placement.SCATTERED, pool)  # 3 blocks
        region = KVRegion.from_kv_caches(allocate_pool(work))
        table = piece_table(region, work.runs(0))
        assert region.layout.pool == pool
        assert int(table[:, 1].sum()) == work.nbytes
        if len(work.runs(0)) == 3:  # nothing merged
            assert table.shape == (3 * per_block, 3)
            assert set(table[:, 1].tolist()) == {work.nbytes // (3 * per_block)}  # 2 MiB or 32 KiB pieces


def test_rows_are_verified_for_limits_nixl_and_connectors_in_both_pools(redis_url):
    methods = [Method.LIMIT_MEMCPY, Method.LIMIT_TCP, Method.NIXL, Method.TCP, Method.SHM]
    rows = bench_transfer(methods, [32], [Placement.SCATTERED], [KVWIRE, VLLM], runs=2, warmup=0,
                          redis_url=redis_url)
    assert [(r.method, r.pool) for r in rows] == [(m.value, p) for p in ("kvwire", "vllm") for m in methods]
    assert len(rows) == combinations(methods, [32], [Placement.SCATTERED], [KVWIRE, VLLM])
    for r in rows:
        if (r.method, r.pool) == ("shm", "vllm") and r.error is not None:
            continue  # tried, not filtered: a transport that refuses vLLM's pool says why in the row
        assert r.error is None and r.verified and r.runs == 2 and r.bytes == 2 * 2 * 1024 * 1024  # 2 blocks, 2 MiB
        assert 0 < r.gbps_min <= r.gbps_median <= r.gbps_max
        assert (r.protocol is not None) == (r.method == "nixl")  # NIXL's rows name UCX's protocol
    nixl = [r.protocol for r in rows if r.method == "nixl"]
    assert all(p is not None and p.startswith("remote memory read") and "into host memory" in p for p in nixl)


def test_cli_prints_json_rows_and_draws_the_plot(tmp_path):
    png = tmp_path / "transfer.png"
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "transfer", "--tokens", "16,32",
                           "--methods", "limit-memcpy,ucx,nixl-tcp", "--layouts", "contiguous", "--pools", "kvwire",
                           "--runs", "1", "--warmup", "0", "--json", "--plot", str(png)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert {(r["method"], r["tokens"]) for r in rows} == {(m, t) for m in ("limit-memcpy", "ucx", "nixl-tcp")
                                                          for t in (16, 32)}
    assert all(r["verified"] and r["layout"] == "contiguous" and r["pool"] == "kvwire" for r in rows)
    # UCX_TLS=tcp reaches NIXL's processes (forked from a server that predates it): UCX says it put over TCP
    assert all("remote memory write" in r["protocol"] and "tcp/lo" in r["protocol"] and "cma" not in r["protocol"]
               for r in rows if r["method"] == "nixl-tcp")
    assert all(r["protocol"] is None for r in rows if r["method"] != "nixl-tcp")
    for cpu in (r["cpu"] for r in rows):  # None when the runs were too short for the host's counters to tick
        assert cpu is None or 0 <= cpu["kernel"] <= cpu["busy"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_at_debug_says_where_each_ucx_pulls_time_went_on_both_sides():
    """`--log-level DEBUG` reaches the producer's process too (forked from a server that predates it)."""
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "transfer", "--tokens", "64",
                           "--methods", "ucx", "--layouts", "scattered", "--pools", "vllm", "--runs", "1",
                           "--warmup", "0", "--json", "--log-level", "DEBUG"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    sent = [line for line in done.stderr.splitlines() if "ucx.send_engine" in line and " sent bench-ucx-64" in line]
    pulled = [line for line in done.stderr.splitlines() if "ucx.puller" in line and " pulled bench-ucx-64" in line]
    assert len(sent) == len(pulled) == 1, done.stderr[-3000:]
    assert re.search(r"\d+ messages \(\d+ packed\), [\d.]+ ms since it was built, [\d.]+ ms of it packing", sent[0])
    assert re.search(r"257 pieces in [\d.]+ ms; lane 0: ", pulled[0])  # 32 layers x 2 planes x 4 blocks + hidden
    producer, consumer = (re.search(r"\[(\d+)\]", line).group(1) for line in (sent[0], pulled[0]))  # type: ignore
    assert producer != consumer


def test_raw_ucxx_moves_the_same_pieces_verified(redis_url):
    rows = bench_transfer([Method.UCXX_RAW], [32], [Placement.SCATTERED], [VLLM], runs=2, warmup=1,
                          redis_url=redis_url)  # 128 pieces of 32 KiB
    rows += bench_transfer([Method.UCXX_RAW_TCP], [32], [Placement.SCATTERED], [KVWIRE], runs=2, warmup=1,
                           redis_url=redis_url)
    assert [(r.method, r.pool) for r in rows] == [("ucxx-raw", "vllm"), ("ucxx-raw-tcp", "kvwire")]
    for r in rows:
        assert r.verified and r.runs == 2 and r.bytes == 2 * 2 * 1024 * 1024
        assert 0 < r.gbps_min <= r.gbps_median <= r.gbps_max


def test_rounds_interleave_methods_and_pool_their_runs(redis_url):
    seen = []
    rows = bench_transfer([Method.LIMIT_MEMCPY, Method.LIMIT_TCP], [16], [Placement.SCATTERED], [KVWIRE], runs=2,
                          warmup=0, redis_url=redis_url, on_row=lambda r: seen.append(r.method), rounds=3)
    assert seen == ["limit-memcpy", "limit-tcp"] * 3  # one pass over every method per round
    assert [(r.method, r.runs, r.verified) for r in rows] == [("limit-memcpy", 6, True), ("limit-tcp", 6, True)]


def test_target_lines_compare_medians_of_the_same_work():
    from kvwire.bench.report import Row
    from kvwire.bench.transfer import target_lines

    def row(method, gbps, tokens=2048):
        return Row(method=method, tokens=tokens, layout="scattered", pool="kvwire", bytes=1, runs=5,
                   gbps_median=gbps, gbps_min=gbps, gbps_max=gbps, ms_median=1.0, verified=True)

    lines = target_lines([row("limit-tcp", 2.5), row("tcp", 2.0), row("nixl", 5.0), row("ucx", 4.5),
                          row("ucx", 9.0, tokens=128)])  # no nixl at 128 tokens: no line
    assert len(lines) == 2
    assert "ucx / nixl" in lines[0] and "0.90" in lines[0] and "missed" in lines[0]
    assert "tcp / limit-tcp" in lines[1] and "0.80" in lines[1] and "met" in lines[1]


def test_gpu_runs_the_methods_that_move_device_memory_on_one_gpu_and_every_pool_is_tried():
    from kvwire.bench.choices import Device
    from kvwire.bench.transfer import supports

    on_gpu = {m for m in Method if supports(m, Device.CUDA)}
    assert on_gpu == {Method.LIMIT_MEMCPY, Method.LIMIT_GATHER, Method.UCX, Method.SHM, Method.TCP, Method.AUTO,
                      Method.NIXL, Method.NIXL_DEFAULTS}
    assert {m for m in Method if not supports(m)} == {Method.NIXL_DEFAULTS}  # on the host it is `nixl` again
    # no method is filtered by pool: shm and auto over vLLM's pool run, and say so if the transport refuses
    assert combinations([Method.SHM, Method.AUTO], [16], [Placement.SCATTERED], [KVWIRE, VLLM], Device.CUDA) == 4


def test_nixl_on_a_gpu_reads_with_cuda_ipc_get_enabled_and_a_defaults_row_beside_it():
    from kvwire.bench.choices import Device
    from kvwire.bench.nixl_run import NixlOp, memory_type
    from kvwire.bench.transfer import CUDA_IPC_GET, NIXL_OPS, TCP_ONLY, nixl_settings

    assert CUDA_IPC_GET == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert nixl_settings(Method.NIXL, Device.CUDA) == CUDA_IPC_GET and nixl_settings(Method.NIXL, Device.CPU) == {}
    assert nixl_settings(Method.NIXL_DEFAULTS, Device.CUDA) == {}  # what a NixlConnector runs with, untuned
    assert nixl_settings(Method.NIXL_TCP, Device.CPU) == TCP_ONLY
    assert NIXL_OPS[Method.NIXL] == NIXL_OPS[Method.NIXL_DEFAULTS] == NixlOp.READ
    assert (memory_type(Device.CUDA), memory_type(Device.CPU)) == ("VRAM", "DRAM")


def test_nixl_descriptors_carry_the_device_a_piece_lives_on():
    from kvwire.bench.workload import descriptors

    class Piece:  # stands in for a tensor on CUDA device 3 (no GPU here)
        def __init__(self, addr: int, nbytes: int, device: int):
            self.addr, self.nbytes, self.device = addr, nbytes, device

        def data_ptr(self) -> int:
            return self.addr

        def numel(self) -> int:
            return self.nbytes // 2

        def element_size(self) -> int:
            return 2

        def get_device(self) -> int:
            return self.device

    table = descriptors([Piece(4096, 32768, 3), Piece(65536, 2 * 2**20, 3)])
    assert table.dtype == "uint64" and table.tolist() == [[4096, 32768, 3], [65536, 2 * 2**20, 3]]
    host = torch.zeros(4, 1024, dtype=torch.uint8)  # a host piece: device 0, as NIXL registers DRAM
    assert descriptors([host[1]]).tolist() == [[host[1].data_ptr(), 1024, 0]]
    assert descriptors([]).shape == (0, 3)


def test_a_method_that_raises_gets_a_row_saying_why_and_the_others_run_on(monkeypatch):
    from kvwire.bench import transfer
    from kvwire.bench.cpu import CpuTicks
    from kvwire.bench.report import table

    calls = []

    def fake(method, work, runs, warmup, redis_url):
        calls.append(method)
        if method == Method.SHM and work.pool == VLLM:
            raise RuntimeError("shm needs a pool it allocated\nmore detail")
        return transfer.Measured([0.01] * runs, True, None, CpuTicks(0, 0, 0, 0))

    monkeypatch.setattr(transfer, "measure", fake)
    rows = transfer.bench_transfer([Method.LIMIT_MEMCPY, Method.SHM], [16], [Placement.SCATTERED], [KVWIRE, VLLM],
                                   runs=2, warmup=0, redis_url="redis://unused", rounds=2)
    assert calls.count(Method.SHM) == 3  # the refusal is not asked again in the second round
    refused = rows[3]
    assert (refused.method, refused.pool, refused.runs, refused.verified) == ("shm", "vllm", 0, False)
    assert refused.error == "RuntimeError: shm needs a pool it allocated"
    assert all(r.verified and r.runs == 4 for r in rows[:3])
    assert "did not run: RuntimeError: shm needs a pool it allocated" in table(rows)
    assert not any("vllm" in line and "shm" in line for line in transfer.target_lines(rows))


def test_nixl_rows_are_skipped_saying_so_where_nixl_is_not_installed(monkeypatch):
    from kvwire.bench import transfer

    monkeypatch.setattr(transfer, "nixl_module", lambda: None)
    missing = transfer.unavailable([Method.NIXL, Method.TCP, Method.NIXL_TCP])
    assert set(missing) == {Method.NIXL, Method.NIXL_TCP}
    assert "NIXL is not installed here (none of nixl_cu13, nixl_cu12)" in missing[Method.NIXL]
    assert combinations([Method.NIXL, Method.TCP], [16], [Placement.SCATTERED], [KVWIRE]) == 1


def test_cli_refuses_a_gpu_layerwise_run():
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "transfer", "--layerwise",
                           "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "host memory only" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_cli_says_so_when_there_is_no_gpu():
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "transfer", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr


def test_limit_gather_moves_the_same_pieces_plane_by_plane(redis_url):
    """The per-plane index_select / index_copy_ baseline (shm's GPU target is half of it) verifies like the rest,
    in both pools, and its target line pairs it with shm."""
    from kvwire.bench.transfer import target_lines

    rows = bench_transfer([Method.LIMIT_GATHER, Method.SHM], [32], [Placement.SCATTERED], [KVWIRE, VLLM],
                          runs=1, warmup=0, redis_url=redis_url)
    assert [(r.method, r.pool, r.verified) for r in rows] == [
        ("limit-gather", "kvwire", True), ("shm", "kvwire", True), ("limit-gather", "vllm", True),
        ("shm", "vllm", True)]
    assert sum("shm / limit-gather" in line for line in target_lines(rows)) == 2
