"""The router fails a request soon after its decode node leaves the cluster, yet lets a node that finished and
then left deliver its last chunk (real redis-server, real zmq)."""

from __future__ import annotations

import asyncio
import time

import zmq

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.control.framing import pack
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import NodeInfo
from kvwire.protocol.work import ErrorKind, SamplingParams, TokenChunk, WorkError
from kvwire.router.dispatch import Dispatcher

WATCH_PERIOD_S = 0.1  # the watchdog's period here (0.5 s by default)
LEFT_GRACE_S = 0.3  # how long a node is missing before its requests fail (1 s by default)


def _node(epoch: int, draining: bool = False) -> NodeInfo:
    return NodeInfo(node_id="decode-w", role=NodeRole.DECODE, epoch=epoch, work_endpoint="tcp://127.0.0.1:9",
                    connector=ConnectorKind.TCP, free_blocks=8, total_blocks=8, draining=draining)


async def _first_error(queue: asyncio.Queue, timeout_s: float) -> tuple[WorkError, float]:
    start = time.monotonic()
    msg = await asyncio.wait_for(queue.get(), timeout_s)
    return msg, time.monotonic() - start


def test_request_fails_fast_when_its_decode_node_goes_and_not_while_it_drains(redis_url):
    directory = KVDirectory(redis_url, namespace="watchdog-test", node_ttl_s=30.0)

    async def scenario():
        dispatcher = Dispatcher(directory, "127.0.0.1", watch_period_s=WATCH_PERIOD_S, left_grace_s=LEFT_GRACE_S)
        dispatcher.start()
        try:
            epoch = directory.next_epoch("decode-w")
            directory.register_node(_node(epoch))
            _, queue = await dispatcher.submit("r-gone", [1, 2], SamplingParams(max_tokens=2))
            directory.register_node(_node(epoch, draining=True))  # draining: still finishing, no verdict
            await asyncio.sleep(2 * LEFT_GRACE_S + 2 * WATCH_PERIOD_S)
            assert queue.empty()
            directory.deregister_node("decode-w")
            msg, waited = await _first_error(queue, 5.0)
            assert isinstance(msg, WorkError) and msg.kind == ErrorKind.NODE_LOST and msg.node == "decode-w"
            assert LEFT_GRACE_S <= waited < LEFT_GRACE_S + 2 * WATCH_PERIOD_S + 0.5
        finally:
            await dispatcher.close()

    try:
        asyncio.run(scenario())
    finally:
        directory.close()


def test_last_chunk_sent_before_the_node_left_still_completes_the_request(redis_url):
    """A drained decode node sends its last chunk, then deregisters; the chunk may reach the router after the
    watch has seen the node gone. The request must complete, not fail as lost."""
    directory = KVDirectory(redis_url, namespace="watchdog-late", node_ttl_s=30.0)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)

    async def scenario():
        dispatcher = Dispatcher(directory, "127.0.0.1", watch_period_s=WATCH_PERIOD_S, left_grace_s=LEFT_GRACE_S)
        dispatcher.start()
        try:
            directory.register_node(_node(directory.next_epoch("decode-w")))
            _, queue = await dispatcher.submit("r-late", [1, 2], SamplingParams(max_tokens=1))
            directory.deregister_node("decode-w")
            await asyncio.sleep(WATCH_PERIOD_S + 0.2)  # at least one watch tick has missed the node
            push.connect(dispatcher.reply_to)
            push.send(pack(TokenChunk(request_id="r-late", token_ids=[7], finished=True, finish_reason="length")))
            msg = await asyncio.wait_for(queue.get(), 5.0)
            assert isinstance(msg, TokenChunk) and msg.finished and msg.token_ids == [7]
            dispatcher.forget("r-late")  # as the HTTP handler does once it has the final chunk
            await asyncio.sleep(LEFT_GRACE_S + 2 * WATCH_PERIOD_S)
            assert queue.empty()  # nothing queued behind the final chunk either
        finally:
            await dispatcher.close()

    try:
        asyncio.run(scenario())
    finally:
        push.close(0)
        directory.close()
