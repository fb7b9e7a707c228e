"""CUDA IPC for the shared-memory connector: another process opens the producer's planes by handle.

The handles travel as a wire message (plain bytes and ints, no pickle); the consumer process must read
the producer's very memory, not a copy: a write the producer makes after the consumer opened the planes
is what the consumer reads next. Two pools: kvwire's (one block-major plane) and vLLM's per-layer KV
tensors (one plane per layer, all inside one allocation, as vLLM allocates them: the handle's offsets
place each). The whole connector on CUDA planes: tests/connectors/transports/shm/test_planes.py and
test_head_slices.py (their `cuda` cases) and tests/gpu/test_disaggregated_gpu.py.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.wire import DType, ShmAccess, ShmSegment, decode, encode
from tests.connectors import peer

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CTX = mp.get_context("spawn")


def _read_by_handle(payload: bytes, blocks: list[int], requests, replies) -> None:
    from kvwire.connectors.transports.shm.cuda_ipc import open_planes, synchronize

    planes = open_planes(decode(payload, expect=ShmSegment))
    while requests.get(timeout=60) == "read":
        out = torch.stack([p[blocks] for p in planes])  # [planes, blocks, row]
        synchronize([out])
        replies.put(out.cpu().numpy().tobytes())


def _kvwire_region() -> KVRegion:
    pool = KVPool.allocate(peer.layout(DType.BFLOAT16, 4, 16), 8, torch.device("cuda:0"))
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda:0").to(torch.bfloat16))
    return KVRegion((pool.blocks_as_bytes(),), pool.layout)


def _vllm_region() -> KVRegion:
    buffer = torch.randn(3 * 8 * 2 * 16 * 128, device="cuda:0").to(torch.bfloat16)  # one allocation, every layer
    layers = buffer.view(3, 8, 2, 16, 128)  # [layers, blocks, kv_heads, block_size, 2 * head_dim]: LBHNC
    return region_of({f"layer.{i}": layers[i] for i in range(3)}, 8, 16)


@pytest.mark.skipif(GPUS < 1, reason=f"CUDA IPC needs a CUDA device, found {GPUS}")
@pytest.mark.parametrize("make", [_kvwire_region, _vllm_region], ids=["kvwire-pool", "vllm-per-layer"])
def test_another_process_reads_the_planes_themselves_by_ipc_handle(make):
    from kvwire.connectors.transports.shm.cuda_ipc import CudaPlanes

    region = make()
    msg, fds = CudaPlanes("ipc-producer", 1, region).export()
    assert fds == [] and msg.access == ShmAccess.CUDA_IPC and len(msg.planes) == len(region.planes)
    assert len(msg.storages) == 1, "planes in one allocation share one handle"
    torch.cuda.synchronize()  # what a producer does before READY (producer/role.py)

    def want() -> bytes:
        return torch.stack([p[[3, 5]] for p in region.planes]).cpu().numpy().tobytes()

    requests, replies = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_read_by_handle, args=(encode(msg), [3, 5], requests, replies))
    proc.start()
    try:
        requests.put("read")
        assert replies.get(timeout=120) == want()
        for plane in region.planes:
            plane[5].fill_(7)  # a write after the consumer opened the planes: it must see it
        torch.cuda.synchronize()
        requests.put("read")
        assert replies.get(timeout=60) == want()
        requests.put("stop")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()

