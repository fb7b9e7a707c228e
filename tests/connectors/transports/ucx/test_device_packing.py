"""Device-sized packs (connectors/transports/ucx/packing.py): the plan, tensor slots, and their discarding.

A device pool's pieces are gathered into slots on its device and scattered from them; here CPU tensors
stand in for the device (`tensor_slots(cpu)`, tensor parts), so the same plan, gather, scatter and flow
code runs as on a GPU, over real UCX. What only a GPU shows (CUDA ordering, cuda_ipc) is in
tests/gpu/test_device_packing_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

from kvwire.connectors.transports.kv_region import plan_runs
from kvwire.connectors.transports.ucx.flows import PULL_SLOTS, ReceiveFlow, SendFlow
from kvwire.connectors.transports.ucx.lanes import LANE_SLOTS, ReceiveLanes
from kvwire.connectors.transports.ucx.packing import (
    DEVICE_PACK_BELOW,
    DEVICE_PACK_BYTES,
    DEVICE_SEND_SLOTS,
    PACK_BELOW,
    PACK_BYTES,
    Message,
    SendStaging,
    Staging,
    gather,
    pack_bytes,
    plan_messages,
    scatter,
    tensor_slots,
)
from kvwire.connectors.transports.ucx.worker import DEVICE_PACK_BIT, PACKED_BIT, Role, UCXWorker, tag_of
from kvwire.connectors.vllm.layout import region_of
from tests.connectors.transports.ucx.test_packing import _run

KIB, MIB = 1 << 10, 1 << 20
CPU = torch.device("cpu")


def _vllm_region(blocks: int, heads: int = 8, seed: int = 0):
    """vLLM's per-layer `[blocks, heads, tokens, 2 * head_dim]` bf16 views, 4 layers: 64 KiB a block's row."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"layer.{i}": torch.randn(blocks, heads, 16, 256, generator=gen).to(torch.bfloat16) for i in range(4)}
    return region_of(tensors, blocks, 16)


def _rand(n: int) -> torch.Tensor:
    return torch.randint(0, 255, (n,), dtype=torch.uint8)


def test_a_device_pool_asks_for_device_sized_packs_and_a_host_pool_is_unchanged():
    assert pack_bytes(0) == pack_bytes(PACK_BELOW) == PACK_BYTES  # host pools: as before
    assert pack_bytes(PACK_BELOW + 1) == pack_bytes(DEVICE_PACK_BELOW) == DEVICE_PACK_BYTES
    assert DEVICE_PACK_BELOW <= PACK_BYTES  # an older producer takes the threshold ...
    tags = {tag_of(3, 5, False), tag_of(3, 5, True), tag_of(3, 5, True, device_packs=True)}
    assert len(tags) == 3  # ... but its host-sized packs can never match a device-sized receive
    assert tag_of(3, 5, True, device_packs=True) & (PACKED_BIT | DEVICE_PACK_BIT) == PACKED_BIT | DEVICE_PACK_BIT


def test_vllm_pieces_travel_in_few_device_packs_and_large_runs_alone():
    """A 2,048-token Llama-3-8B request in vLLM's per-layer pool: 8,192 pieces of 32 KiB, 256 MiB, in 32 packs."""
    plan = plan_messages([32 * KIB] * 8192, DEVICE_PACK_BELOW)
    assert len(plan) == 32 and all(m.packed and m.nbytes == DEVICE_PACK_BYTES for m in plan)
    sizes = [32 * KIB] * 3 + [MIB] + [600 * KIB, 2 * MIB, 7]  # a run of 1 MiB or more goes zero-copy, alone
    assert plan_messages(sizes, DEVICE_PACK_BELOW) == [
        Message(0, 3, 96 * KIB, True), Message(3, 1, MIB, False), Message(4, 1, 600 * KIB, True),
        Message(5, 1, 2 * MIB, False), Message(6, 1, 7, True)]
    assert len(plan_messages([32 * KIB] * 8192, PACK_BELOW)) == 256  # a host pool's 1 MiB packs, as before


@pytest.mark.parametrize("heads", [None, (2, 4)], ids=["whole-blocks", "head-slice"])
@pytest.mark.parametrize("layer_major", [False, True])
def test_both_sides_derive_the_same_messages_from_their_own_pools(heads, layer_major):
    """The producer plans from its blocks, the consumer from its own (other ids, runs cut alike): one list."""
    rng = random.Random(1)
    src_ids, dst_ids = sorted(rng.sample(range(64), 20)), rng.sample(range(48), 20)
    src_ids[:6] = range(40, 46)  # one run consecutive on both sides
    dst_ids[:6] = range(10, 16)
    runs = plan_runs(src_ids, dst_ids)
    sides = []
    for region, at in ((_vllm_region(64), 0), (_vllm_region(48), 1)):
        if heads is not None:
            region = region.heads(heads[0], heads[1])
        side_runs = [(r[at], r[2]) for r in runs]
        kv = region.layer_major_parts(side_runs) if layer_major else region.parts(side_runs)
        sides.append([len(p) if isinstance(p, memoryview) else p.numel() for p in kv] + [24 * 4096])  # + hidden
    assert sides[0] == sides[1]
    boundary = (len(sides[0]) - 1) // 4 if layer_major else 0
    plan = plan_messages(sides[0], DEVICE_PACK_BELOW, boundary)
    assert [i for m in plan for i in range(m.first, m.first + m.count)] == list(range(len(sides[0])))
    assert any(m.count > 1 for m in plan) and all(m.nbytes <= DEVICE_PACK_BYTES for m in plan)


def test_tensor_slots_gather_and_scatter_every_byte_mixed_pieces_included():
    """Pieces on the slot's device (one cat, one split), and a pack that also holds host memory (hidden states
    elsewhere) and an empty piece: byte for byte back."""
    staging = Staging(2, DEVICE_PACK_BYTES, tensor_slots(CPU))
    slot = staging.take()
    assert isinstance(slot, torch.Tensor) and slot.numel() == DEVICE_PACK_BYTES
    src = [_rand(n) for n in (3, 70_000, 1, 32 * KIB)]
    dst = [torch.zeros_like(t) for t in src]
    msg = Message(0, 4, sum(t.numel() for t in src), True)
    assert torch.equal(gather(list(src), msg, slot), torch.cat(src))
    scatter(slot, list(dst), msg)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))

    host = memoryview(bytearray(_rand(5000).numpy().tobytes()))
    mixed_src = [src[0], host, memoryview(bytearray()), src[1]]
    mixed_dst = [torch.zeros(3, dtype=torch.uint8), memoryview(bytearray(5000)), memoryview(bytearray()),
                 torch.zeros(70_000, dtype=torch.uint8)]
    msg = Message(0, 4, 75_003, True)
    assert gather(mixed_src, msg, slot).numel() == 75_003
    scatter(slot, mixed_dst, msg)
    assert bytes(mixed_dst[1]) == bytes(host) and torch.equal(mixed_dst[3], src[1])


def test_a_producer_stages_device_packs_on_the_pieces_device_and_host_packs_on_the_host():
    staging = SendStaging()
    device_parts = [torch.zeros(8, dtype=torch.uint8)]  # a tensor part: device memory (the CPU stands in)
    device = staging.for_pull(device_parts, DEVICE_PACK_BELOW)
    assert (device.slot_bytes, device.max_slots) == (DEVICE_PACK_BYTES, DEVICE_SEND_SLOTS)
    assert isinstance(device.take(), torch.Tensor)
    assert staging.for_pull(device_parts, DEVICE_PACK_BELOW) is device  # one pool, shared by every pull
    for_host_pool = staging.for_pull(device_parts, PACK_BELOW)  # a host pool's consumer: host slots, as before
    assert for_host_pool.slot_bytes == PACK_BYTES and isinstance(for_host_pool.take(), memoryview)
    from_host = staging.for_pull([memoryview(bytearray(8))], DEVICE_PACK_BELOW)  # a host pool's pieces
    assert from_host.slot_bytes == DEVICE_PACK_BYTES and isinstance(from_host.take(), memoryview)
    assert len({id(device), id(for_host_pool), id(from_host)}) == 3


def test_device_pieces_cross_ucx_packed_in_tensor_slots_byte_exact():
    """More device-sized packs than either side has slots, a zero-copy piece between them, the hidden states in
    host memory: every byte lands, and every slot comes back to its pool."""
    sizes = [*[32 * KIB] * 700, 3 * MIB, *[64 * KIB] * 200, 11, 96 * KIB]
    src: list = [_rand(n) for n in sizes]
    dst: list = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    src[-1] = memoryview(src[-1].numpy())  # hidden states on the host
    dst[-1] = memoryview(dst[-1].numpy())
    producer, consumer = UCXWorker(Role.PRODUCER), ReceiveLanes(1, CPU)
    try:
        consumer.post(producer.address, dst, 4, DEVICE_PACK_BELOW)
        staging = SendStaging().for_pull(src, DEVICE_PACK_BELOW)
        sends = SendFlow(producer, consumer.address, src, 4, DEVICE_PACK_BELOW, staging)
        assert _run(consumer, producer, sends, timeout_s=20.0), "transfer did not complete"
        consumer.check_errors()
        sends.check_errors()
        assert all(torch.equal(torch.as_tensor(s), torch.as_tensor(d)) for s, d in zip(src, dst))
        slots = [staging.take() for _ in range(DEVICE_SEND_SLOTS)]
        assert all(isinstance(s, torch.Tensor) for s in slots) and staging.take() is None  # none lost
    finally:
        consumer.close()
        producer.close()


def test_host_sized_packs_never_land_in_device_sized_receives():
    """A producer that packs a device pool's pieces at the host size (an older build reading the same threshold)
    sends messages no device-sized receive takes: the pull stalls and is cancelled, nothing was written."""
    dst = [torch.zeros(1000, dtype=torch.uint8) for _ in range(4)]
    producer, consumer = UCXWorker(Role.PRODUCER), ReceiveLanes(1, CPU)
    try:
        consumer.post(producer.address, list(dst), 9, DEVICE_PACK_BELOW)
        src = [torch.full((1000,), 7, dtype=torch.uint8) for _ in range(4)]
        sends = SendFlow(producer, consumer.address, list(src), 9, PACK_BELOW, Staging(2))  # untagged as device
        assert not _run(consumer, producer, sends, timeout_s=0.5)
        assert consumer.stop(producer.address) == 1  # the one packed receive
        assert all(not t.any() for t in dst)
    finally:
        consumer.close()
        producer.close()


def test_slots_of_a_failed_pull_are_discarded_on_both_sides_never_reused():
    """A consumer that stops reading: the producer's pull holds half its device slots; dropped after the failure,
    they are never handed out again (nor are the consumer's), and fresh ones take their place."""
    producer, stuck = UCXWorker(Role.PRODUCER), UCXWorker(Role.CONSUMER)
    send_staging = Staging(DEVICE_SEND_SLOTS, DEVICE_PACK_BYTES, tensor_slots(CPU))
    recv_staging = Staging(2, DEVICE_PACK_BYTES, tensor_slots(CPU))
    try:
        parts = [torch.zeros(512 * KIB, dtype=torch.uint8) for _ in range(100)]  # 7 packs of 8 MiB at most
        recv = ReceiveFlow(stuck, producer.address, [torch.zeros_like(p) for p in parts], 3, DEVICE_PACK_BELOW,
                           recv_staging)  # posted, never progressed
        sends = SendFlow(producer, stuck.address, parts, 3, DEVICE_PACK_BELOW, send_staging)
        for _ in range(20):
            producer.progress()
            sends.advance()
        assert not sends.done()
        in_flight = [p[2] for p in sends._packs]  # test-only reach: the slots the pull holds
        assert len(in_flight) == min(PULL_SLOTS, DEVICE_SEND_SLOTS // 2)
        posted = [p[2] for p in recv._packs]
        assert len(posted) == 2
        sends.discard_slots()
        recv.discard_slots()
        for staging, gone in ((send_staging, in_flight), (recv_staging, posted)):
            fresh = [staging.take() for _ in range(staging.max_slots)]
            assert None not in fresh and staging.take() is None
            assert not {id(s) for s in fresh} & {id(s) for s in gone}
    finally:
        stuck.abandon(producer.address)
        stuck.close()
        producer.close()


def pull_by_address(blocks: int = 300) -> bool:
    """Both sides' pieces as `DevicePieces` (what a GPU pool's pull uses) over real UCX in tensor slots: more packs
    than slots; every byte lands where `parts` says. Returns whether the pack kernel copied them (both sides'
    address tables uploaded) rather than the views."""
    from kvwire.connectors.transports.piece_copy import DevicePieces

    src, dst = _vllm_region(blocks, seed=1), _vllm_region(blocks, seed=2)
    src_runs, dst_runs = [(b, 1) for b in range(0, blocks, 2)], [(b, 1) for b in range(blocks - 1, 0, -2)]
    sent, landing = DevicePieces(src, src.spans(src_runs)), DevicePieces(dst, dst.spans(dst_runs))
    assert len(plan_messages(sent.sizes, DEVICE_PACK_BELOW)) > LANE_SLOTS  # 300 blocks: 600 pieces, 5 packs
    producer, consumer = UCXWorker(Role.PRODUCER), ReceiveLanes(1, CPU)
    try:
        consumer.post(producer.address, landing, 6, DEVICE_PACK_BELOW)
        staging = SendStaging().for_pull(sent, DEVICE_PACK_BELOW)
        assert isinstance(staging.take(), torch.Tensor)  # device slots, on the pieces' device
        sends = SendFlow(producer, consumer.address, sent, 6, DEVICE_PACK_BELOW, staging)
        assert _run(consumer, producer, sends, timeout_s=60.0), "transfer did not complete"
        consumer.check_errors()
        sends.check_errors()
    finally:
        consumer.close()
        producer.close()
    for (s, _), (d, _) in zip(src_runs, dst_runs):
        assert all(torch.equal(sp[s], dp[d]) for sp, dp in zip(src.planes, dst.planes))
    return sent._table is not None and landing._table is not None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the kernel serves under the interpreter")
def test_a_vllm_pull_known_by_address_crosses_ucx_in_device_packs_byte_exact():
    """Without the kernel (a CPU pool, no interpreter) packs go through the views."""
    assert not pull_by_address()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (torch's CPU build "
                    "lacks it; GPU installs have it)")
def test_the_pack_kernel_moves_a_vllm_pull_over_ucx_in_tritons_interpreter():
    """The same pull with the kernel packing and unpacking every slot (Triton's interpreter, in a child)."""
    script = ("from tests.connectors.transports.ucx.test_device_packing import pull_by_address\n"
              "assert pull_by_address()\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
