"""Where the router places a prompt over kvwire's own decode nodes that keep a prefix cache (router/placement.py):
a conversation's next turn on the node that holds its earlier turns (what it was sent, then what it answered, read
from the decode node's replies on the real reply socket), decode-only there when little of it is left to compute;
unrelated prompts spread; a restarted node, a node without a prefix cache and `--routing load` hold nothing."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.control.framing import pack
from kvwire.connectors.wire import NodeInfo
from kvwire.observability.labels import PathReason
from kvwire.protocol.work import SamplingParams, TokenChunk
from kvwire.router.config import RoutingPolicy
from kvwire.router.dispatch import Dispatcher
from kvwire.router.placement import Placement

BLOCK = 4


def _node(node_id: str, role: NodeRole, cache: bool = True, free: int = 64) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, epoch=1, work_endpoint="tcp://127.0.0.1:9", connector=ConnectorKind.TCP,
                    free_blocks=free, total_blocks=64, block_size=BLOCK, prefix_cache=cache)


class _Directory:
    def __init__(self, nodes: list[NodeInfo]):
        self.nodes = nodes

    def live_nodes(self, role: NodeRole | None = None, include_draining: bool = False) -> list[NodeInfo]:
        return [n for n in self.nodes if role is None or n.role == role]


NODES = [_node("p0", NodeRole.PREFILL, cache=False), _node("d0", NodeRole.DECODE), _node("d1", NodeRole.DECODE)]
FIRST = list(range(100, 120))  # 20 tokens: 5 blocks
ANSWER = [7, 7, 7, 7, 7, 7]


async def _turn(dispatcher: Dispatcher, decode_node: zmq.asyncio.Socket, rid: str, prompt: list[int],
                answer: list[int]):
    """Submit `prompt`; its decode node answers `answer` in two chunks, the last finished. Returns: its route."""
    route, replies = await dispatcher.submit(rid, prompt, SamplingParams(max_tokens=len(answer)))
    await decode_node.send(pack(TokenChunk(request_id=rid, token_ids=answer[:1])))
    await decode_node.send(pack(TokenChunk(request_id=rid, token_ids=answer[1:], finished=True)))
    for _ in range(2):
        await asyncio.wait_for(replies.get(), 5)
    dispatcher.forget(rid)
    return route


def _conversation(nodes: list[NodeInfo], **policy) -> tuple[list, list]:
    """Two turns of one conversation, then two unrelated prompts. Returns: their routes, and a pick of turn three
    made after the decode nodes restarted."""
    async def scenario():
        dispatcher = Dispatcher(_Directory(nodes), "127.0.0.1", **policy)  # type: ignore[arg-type]
        dispatcher.start()
        decode_node = zmq.asyncio.Context.instance().socket(zmq.PUSH)  # as a decode node answers the router
        decode_node.connect(dispatcher.reply_to)
        try:
            one = await _turn(dispatcher, decode_node, "t1", FIRST, ANSWER)
            second = FIRST + ANSWER + [9, 9, 9]  # 29 tokens, 26 held where the first turn went
            two = await _turn(dispatcher, decode_node, "t2", second, ANSWER)
            others = [await _turn(dispatcher, decode_node, f"u{i}", list(range(500 * i, 500 * i + 20)), ANSWER)
                      for i in (1, 2)]
            restarted = [*nodes[:1], *(msgspec.structs.replace(n, epoch=2) for n in nodes[1:])]
            three = dispatcher.pick(second + ANSWER + [3], nodes=restarted)
            return [one, two, *others], three
        finally:
            decode_node.close(0)
            await dispatcher.close()

    return asyncio.run(scenario())


def test_a_conversations_next_turn_goes_where_its_kv_is_and_is_decode_only_there():
    (one, two, *others), after_restart = _conversation(NODES, decode_only_below=8)
    assert (one.reason, two.reason) == (PathReason.PREFILLED, PathReason.CACHED_ON_DECODE)
    assert two.decode.node_id == one.decode.node_id and two.prefill is None
    assert {r.decode.node_id for r in others} == {"d0", "d1"}  # unrelated, equally free: one each, in turn
    assert after_restart.reason == PathReason.PREFILLED  # a restarted node's cache is empty


def test_by_default_a_cached_turn_still_goes_to_its_node_but_is_disaggregated():
    (one, two, *_), _ = _conversation(NODES)
    assert two.decode.node_id == one.decode.node_id and two.reason == PathReason.PREFILLED


def test_a_fuller_node_loses_a_turn_whose_cached_part_is_smaller_than_its_fullness():
    nodes = [NODES[0], _node("d0", NodeRole.DECODE, free=64), _node("d1", NodeRole.DECODE, free=64)]
    dispatcher = Dispatcher(_Directory(nodes), "127.0.0.1")  # type: ignore[arg-type]
    first = dispatcher.pick(FIRST, request_id="t1")
    busy = [n if n.node_id != first.decode.node_id else msgspec.structs.replace(n, free_blocks=10) for n in nodes]
    assert dispatcher.pick(FIRST + [1], nodes=busy).decode.node_id != first.decode.node_id  # 5 blocks < 54
    asyncio.run(dispatcher.close())


def test_without_prefix_caches_or_with_load_routing_nothing_is_predicted():
    no_cache = [NODES[0], _node("d0", NodeRole.DECODE, cache=False), _node("d1", NodeRole.DECODE, cache=False)]
    (one, two, *_), _ = _conversation(no_cache, decode_only_below=8)
    assert two.decode.node_id != one.decode.node_id and two.reason == PathReason.PREFILLED  # in turn
    (one, two, *_), _ = _conversation(NODES, decode_only_below=8, routing=RoutingPolicy.LOAD)
    assert two.decode.node_id != one.decode.node_id and two.reason == PathReason.PREFILLED


def _beat(node: NodeInfo, at: float, used: int) -> NodeInfo:
    return msgspec.structs.replace(node, heartbeat_at=at, free_blocks=node.total_blocks - used)


def test_requests_picked_since_a_heartbeat_weigh_on_their_node():
    """d0's last heartbeat showed no block in use and d1's 4; three 12-token prompts (3 blocks each) picked after
    those beats: the third goes to d1, where by the heartbeats alone all three would go to d0."""
    beat = time.time() - 1
    nodes = [NODES[0], _beat(_node("d0", NodeRole.DECODE, cache=False), beat, 0),
             _beat(_node("d1", NodeRole.DECODE, cache=False), beat, 4)]
    dispatcher = Dispatcher(_Directory(nodes), "127.0.0.1")  # type: ignore[arg-type]
    picked = [dispatcher.pick(list(range(12)), request_id=f"r{i}").decode.node_id for i in range(3)]
    assert picked == ["d0", "d0", "d1"]
    dispatcher.forget("r0")
    dispatcher.forget("r1")  # gone before any heartbeat showed them: d0 is the freer again
    assert dispatcher.pick(list(range(12)), request_id="r3").decode.node_id == "d0"
    asyncio.run(dispatcher.close())


def test_a_heartbeat_taken_while_a_request_ran_is_corrected_once_it_ended():
    """r0 (10 blocks: 12 prompt tokens and 28 max_tokens) runs on d1; d1's heartbeat, taken meanwhile, shows its 10
    blocks in use. r0 has ended since, so d1 is taken as empty and beats d0, whose heartbeat shows 2 in use."""
    d0, d1 = _node("d0", NodeRole.DECODE, cache=False), _node("d1", NodeRole.DECODE, cache=False)
    dispatcher = Dispatcher(_Directory([NODES[0], d0, d1]), "127.0.0.1")  # type: ignore[arg-type]
    assert dispatcher.pick(list(range(12)), request_id="r0", max_tokens=28).decode.node_id == "d1"  # in turn
    beat = time.time()
    dispatcher.forget("r0")
    seen = [NODES[0], _beat(d0, beat, 2), _beat(d1, beat, 10)]
    assert dispatcher.pick(list(range(12)), nodes=seen, request_id="r1").decode.node_id == "d1"
    asyncio.run(dispatcher.close())


@pytest.mark.parametrize("cache", [True, False])
def test_prompts_sharing_a_system_prompt_go_to_the_prefill_node_that_computed_it(cache):
    """Prefill nodes keep a prefix cache too: the later prompts after one system prompt go where its blocks are
    (without the cache, equally free nodes take turns)."""
    nodes = [_node("p0", NodeRole.PREFILL, cache=cache), _node("p1", NodeRole.PREFILL, cache=cache),
             _node("d0", NodeRole.DECODE)]
    placement = Placement(_Directory(nodes))  # type: ignore[arg-type]
    system = list(range(100, 140))  # 10 blocks
    picked = []
    for question in ([1] * 6, [2] * 7, [3] * 5, [4] * 6):
        route, _ = placement.pick(system + question, True, nodes, [])
        assert route.reason == PathReason.PREFILLED and route.prefill is not None
        picked.append(route.prefill.node_id)
    assert len(set(picked)) == (1 if cache else 2), picked
