"""Which path the router gives a request over kvwire's own nodes (router/placement.py, through router/dispatch.py's
`pick`): decode-only for a prompt shorter than decode_only_below, for one the client kept whole, without a live
prefill node, or while every prefill node has prefill_max_in_flight requests in flight; a request stays in flight on
its prefill node until its first reply arrives or it is forgotten."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
import zmq.asyncio

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.control.framing import pack
from kvwire.connectors.wire import NodeInfo
from kvwire.observability.labels import PathReason, ProxyPath
from kvwire.protocol.work import SamplingParams, TokenChunk
from kvwire.router.dispatch import Dispatcher
from kvwire.router.schemas import APIError


def _node(node_id: str, role: NodeRole, free: int = 8, model: str = "", block_size: int = 0) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, epoch=1, work_endpoint="tcp://127.0.0.1:9", connector=ConnectorKind.TCP,
                    free_blocks=free, total_blocks=8, model=model, block_size=block_size)


class _Directory:
    """The live nodes, as `pick` (every role) and the watchdog (decode nodes) read them."""

    def __init__(self, nodes: list[NodeInfo]):
        self.nodes = nodes

    def live_nodes(self, role: NodeRole | None = None, include_draining: bool = False) -> list[NodeInfo]:
        return [n for n in self.nodes if role is None or n.role == role]


def _dispatcher(nodes: list[NodeInfo], **policy: int) -> Dispatcher:
    return Dispatcher(_Directory(nodes), "127.0.0.1", **policy)  # type: ignore[arg-type]


PAIR = [_node("p0", NodeRole.PREFILL), _node("d0", NodeRole.DECODE)]


def _prompt(tokens: int) -> list[int]:
    return list(range(tokens))


def test_short_prompts_go_decode_only_and_longer_ones_are_disaggregated():
    dispatcher = _dispatcher(PAIR, decode_only_below=16)
    short, long_ = dispatcher.pick(_prompt(15)), dispatcher.pick(_prompt(16))
    assert (short.prefill, short.decode.node_id, short.reason, short.path) == \
        (None, "d0", PathReason.SHORT_PROMPT, ProxyPath.DECODE_ONLY)
    assert (long_.prefill and long_.prefill.node_id, long_.reason, long_.path) == \
        ("p0", PathReason.PREFILLED, ProxyPath.DISAGGREGATED)


def test_by_default_every_prompt_is_disaggregated_unless_the_client_keeps_it_whole():
    dispatcher = _dispatcher(PAIR)
    assert dispatcher.pick(_prompt(1)).reason == PathReason.PREFILLED
    assert dispatcher.pick(_prompt(1000), disaggregate=False).reason == PathReason.NOT_ASKED
    assert _dispatcher(PAIR[1:]).pick(_prompt(1000)).reason == PathReason.NO_PREFILL_INSTANCE


def test_a_prefill_node_of_another_checkpoint_is_not_paired():
    """Its KV would be refused (a mismatch): the prompt stays on decode, and the reason says so."""
    other = [_node("p0", NodeRole.PREFILL, free=8, model="aaaa"), _node("d0", NodeRole.DECODE, model="bbbb")]
    route = _dispatcher(other).pick(_prompt(100))
    assert (route.prefill, route.reason, route.path) == (None, PathReason.PREFILL_OTHER_MODEL, ProxyPath.DECODE_ONLY)
    # one of the same checkpoint is picked, even with fewer free blocks; one that does not say (older) is too
    both = [*other, _node("p1", NodeRole.PREFILL, free=2, model="bbbb")]
    assert _dispatcher(both).pick(_prompt(100)).prefill.node_id == "p1"  # type: ignore[union-attr]
    unknown = [_node("p0", NodeRole.PREFILL), _node("d0", NodeRole.DECODE, model="bbbb")]
    assert _dispatcher(unknown).pick(_prompt(100)).reason == PathReason.PREFILLED


def test_a_prefill_node_of_another_block_size_is_not_paired():
    """KV moves only between equal block sizes: the prompt stays on decode, and the reason says so; a node that
    does not say (older) is paired as before."""
    other = [_node("p0", NodeRole.PREFILL, block_size=32), _node("d0", NodeRole.DECODE, block_size=16)]
    route = _dispatcher(other).pick(_prompt(100))
    assert (route.prefill, route.reason, route.path) == (None, PathReason.PREFILL_OTHER_BLOCK_SIZE,
                                                         ProxyPath.DECODE_ONLY)
    both = [*other, _node("p1", NodeRole.PREFILL, free=2, block_size=16)]
    assert _dispatcher(both).pick(_prompt(100)).prefill.node_id == "p1"  # type: ignore[union-attr]
    unknown = [_node("p0", NodeRole.PREFILL), _node("d0", NodeRole.DECODE, block_size=16)]
    assert _dispatcher(unknown).pick(_prompt(100)).reason == PathReason.PREFILLED


def test_no_decode_node_is_a_503():
    with pytest.raises(APIError) as exc:
        _dispatcher(PAIR[:1]).pick(_prompt(10))
    assert exc.value.status == 503


def test_saturated_prefill_nodes_are_skipped_then_every_one_sends_decode_only():
    nodes = [_node("p0", NodeRole.PREFILL, free=8), _node("p1", NodeRole.PREFILL, free=4),
             _node("d0", NodeRole.DECODE)]
    dispatcher = _dispatcher(nodes, prefill_max_in_flight=1)
    first, second, third = (dispatcher.pick(_prompt(100), request_id=f"r{i}") for i in range(3))
    assert [r.prefill and r.prefill.node_id for r in (first, second)] == ["p0", "p1"]  # p0 has the most free
    assert (third.prefill, third.reason) == (None, PathReason.PREFILL_SATURATED)


def test_a_pick_without_a_request_id_reserves_nothing():
    dispatcher = _dispatcher(PAIR, prefill_max_in_flight=1)
    assert [dispatcher.pick(_prompt(40)).reason for _ in range(2)] == [PathReason.PREFILLED] * 2
    assert dispatcher.pick(_prompt(40), request_id="r1").reason == PathReason.PREFILLED
    assert dispatcher.pick(_prompt(40)).reason == PathReason.PREFILL_SATURATED  # r1, named, is in flight on p0
    asyncio.run(dispatcher.close())


def test_a_request_leaves_its_prefill_node_at_its_first_reply_or_when_forgotten():
    async def scenario():
        dispatcher = _dispatcher(PAIR, prefill_max_in_flight=1)
        dispatcher.start()
        decode_node = zmq.asyncio.Context.instance().socket(zmq.PUSH)  # as a decode node answers the router
        decode_node.connect(dispatcher.reply_to)
        try:
            route, replies = await dispatcher.submit("r1", [1] * 40, SamplingParams(max_tokens=2))
            assert route.reason == PathReason.PREFILLED
            assert dispatcher.pick(_prompt(40)).reason == PathReason.PREFILL_SATURATED  # r1 is in flight on p0
            await decode_node.send(pack(TokenChunk(request_id="r1", token_ids=[5])))  # r1's first token
            await asyncio.wait_for(replies.get(), 5)
            route, _ = await dispatcher.submit("r2", [1] * 40, SamplingParams(max_tokens=2))
            assert route.reason == PathReason.PREFILLED  # r1 left p0 at its first token
            await decode_node.send(pack(TokenChunk(request_id="r1", token_ids=[6], finished=True)))
            await asyncio.wait_for(replies.get(), 5)
            assert dispatcher.pick(_prompt(40)).reason == PathReason.PREFILL_SATURATED  # r2 still is: r1 counted once
        finally:
            decode_node.close(0)
            await dispatcher.close()

    asyncio.run(scenario())


def test_a_request_forgotten_before_any_reply_leaves_its_prefill_node():
    async def scenario():
        dispatcher = _dispatcher(PAIR, prefill_max_in_flight=1)
        try:
            await dispatcher.submit("r1", [1] * 40, SamplingParams(max_tokens=2))
            assert dispatcher.pick(_prompt(0), disaggregate=False).reason == PathReason.NOT_ASKED
            dispatcher.forget("r1")  # the client left, or an error ended it, before its first token
            route, _ = await dispatcher.submit("r2", [1] * 40, SamplingParams(max_tokens=2))
            assert route.reason == PathReason.PREFILLED
        finally:
            await dispatcher.close()

    asyncio.run(scenario())


def test_a_request_cancelled_while_the_nodes_are_read_is_never_counted():
    """The client goes away while its submit reads the directory (on a thread): the prefill node it would have
    had is not left counting it (prefill_max_in_flight 1 would otherwise turn every later request away)."""
    reading, release, read = threading.Event(), threading.Event(), threading.Event()

    class _SlowDirectory(_Directory):
        def live_nodes(self, role: NodeRole | None = None, include_draining: bool = False) -> list[NodeInfo]:
            reading.set()
            release.wait(5)
            try:
                return super().live_nodes(role, include_draining)
            finally:
                read.set()

    async def scenario():
        dispatcher = Dispatcher(_SlowDirectory(PAIR), "127.0.0.1", prefill_max_in_flight=1)  # type: ignore[arg-type]
        try:
            task = asyncio.create_task(dispatcher.submit("gone", [1] * 40, SamplingParams(max_tokens=2)))
            await asyncio.to_thread(reading.wait, 5)
            task.cancel()
            await asyncio.sleep(0)
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(read.wait, 5)  # the thread has returned its nodes, to nobody
            dispatcher.forget("gone")  # what the handler does on the way out
            assert dispatcher.pick(_prompt(40), nodes=PAIR).reason == PathReason.PREFILLED
        finally:
            await dispatcher.close()

    asyncio.run(scenario())


def test_a_request_is_placed_on_the_event_loop_while_the_node_list_is_fresh(monkeypatch):
    """No thread hand-off per request: the directory is read (on a thread) only when the shared node list is
    older than NODES_FRESH_S; requests in between are placed on the loop from the list already read."""
    threads: list[str] = []
    real = asyncio.to_thread

    async def counted(fn, *args, **kwargs):
        threads.append(getattr(fn, "__name__", str(fn)))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    directory = _Directory(PAIR)
    reads: list[float] = []
    live = directory.live_nodes
    directory.live_nodes = lambda *a, **kw: reads.append(time.monotonic()) or live(*a, **kw)  # type: ignore

    async def scenario():
        dispatcher = Dispatcher(directory, "127.0.0.1")  # type: ignore[arg-type]
        try:
            for i in range(5):
                await dispatcher.submit(f"r{i}", [1] * 40, SamplingParams(max_tokens=2))
            assert threads == ["live_nodes"] and len(reads) == 1, (threads, reads)
            monkeypatch.setattr("kvwire.router.placement.NODES_FRESH_S", -1.0)  # stale now: read again, on a thread
            await dispatcher.submit("r5", [1] * 40, SamplingParams(max_tokens=2))
            assert len(threads) == 2 and len(reads) == 2
        finally:
            await dispatcher.close()

    asyncio.run(scenario())
