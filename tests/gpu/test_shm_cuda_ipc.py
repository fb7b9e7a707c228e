"""CUDA IPC for the shared-memory connector: another process opens the producer's pool by handle.

The handle travels as a wire message (plain bytes and ints, no pickle); the consumer
process must read the producer's very memory, not a copy: a write the producer makes
after the consumer opened the pool is what the consumer reads next. The whole
connector on CUDA pools is covered by the conformance suite's CUDA runs and by
tests/gpu/test_disaggregated_gpu.py.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kvwire.connectors.wire import DType, ShmSegment, decode, encode
from tests.connectors import peer

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CTX = mp.get_context("spawn")


def _read_by_handle(payload: bytes, blocks: list[int], requests, replies) -> None:
    from kvwire.connectors.transports.shm.cuda_ipc import map_cuda, synchronize

    src = map_cuda(decode(payload, expect=ShmSegment))
    while requests.get(timeout=60) == "read":
        dst = torch.empty((len(blocks), src.shape[1]), dtype=torch.uint8, device=src.device)
        for i, block in enumerate(blocks):
            dst[i].copy_(src[block])
        synchronize([dst])
        replies.put(dst.cpu().numpy().tobytes())


@pytest.mark.skipif(GPUS < 1, reason=f"CUDA IPC needs a CUDA device, found {GPUS}")
def test_another_process_reads_the_pool_itself_by_ipc_handle():
    from kvwire.connectors.transports.shm.cuda_ipc import CudaSegment

    segment = CudaSegment.create("ipc-producer", 1, peer.layout(DType.BFLOAT16, 4, 16), 8, torch.device("cuda:0"))
    pool = segment.pool.blocks_as_bytes()  # [8, block_nbytes] uint8 view of the pool
    segment.pool.data.copy_(torch.randn(segment.pool.data.shape, device="cuda:0").to(torch.bfloat16))
    msg, fds = segment.export()
    assert fds == [] and msg.cuda is not None and msg.block_nbytes == pool.shape[1]
    torch.cuda.synchronize(segment.pool.data.device)  # what a producer does before READY (producer.py)
    requests, replies = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_read_by_handle, args=(encode(msg), [3, 5], requests, replies))
    proc.start()
    try:
        requests.put("read")
        assert replies.get(timeout=120) == pool[[3, 5]].cpu().numpy().tobytes()
        pool[5].fill_(7)  # a write after the consumer opened the pool: it must see it
        torch.cuda.synchronize(segment.pool.data.device)
        requests.put("read")
        assert replies.get(timeout=60) == pool[[3, 5]].cpu().numpy().tobytes()
        requests.put("stop")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()
