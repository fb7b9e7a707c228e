"""The router fails a request at once when its decode node leaves the cluster (real redis-server, real zmq)."""

from __future__ import annotations

import asyncio
import time

from connectors.config import ConnectorKind, NodeRole
from connectors.directory import KVDirectory
from connectors.wire import ErrorKind, NodeInfo, SamplingParams, WorkError
from router.dispatch import Dispatcher


def _node(epoch: int, draining: bool = False) -> NodeInfo:
    return NodeInfo(node_id="decode-w", role=NodeRole.DECODE, epoch=epoch, work_address="tcp://127.0.0.1:9",
                    connector=ConnectorKind.TCP, free_blocks=8, total_blocks=8, draining=draining)


async def _first_error(queue: asyncio.Queue, timeout_s: float) -> tuple[WorkError, float]:
    start = time.monotonic()
    msg = await asyncio.wait_for(queue.get(), timeout_s)
    return msg, time.monotonic() - start


def test_request_fails_fast_when_its_decode_node_goes_and_not_while_it_drains(redis_url):
    directory = KVDirectory(redis_url, namespace="watchdog-test", node_ttl_s=30.0)

    async def scenario():
        dispatcher = Dispatcher(directory, "127.0.0.1")
        dispatcher.start()
        try:
            epoch = directory.next_epoch("decode-w")
            directory.register_node(_node(epoch))
            _, queue = await dispatcher.submit("r-gone", [1, 2], SamplingParams(max_tokens=2))
            directory.register_node(_node(epoch, draining=True))  # draining: still finishing, no verdict
            await asyncio.sleep(2.5)
            assert queue.empty()
            directory.deregister_node("decode-w")
            msg, waited = await _first_error(queue, 5.0)
            assert isinstance(msg, WorkError) and msg.kind == ErrorKind.NODE_LOST and msg.node == "decode-w"
            assert waited < 2.5
        finally:
            await dispatcher.close()

    try:
        asyncio.run(scenario())
    finally:
        directory.close()
