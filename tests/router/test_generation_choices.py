"""A request's later choices (n > 1, best_of) over kvwire's own nodes (router/generation.py): sent to the decode
node of their prompt's first choice, to start from its prompt KV there (`DecodeWork.prompt_of`, no prefill node),
when that node says it does; each picked as a first one when it does not (an older node)."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.control.framing import unpack
from kvwire.connectors.wire import NodeInfo
from kvwire.observability.labels import PathReason, ProxyPath
from kvwire.protocol.work import DecodeWork, PrefillWork, SamplingParams
from kvwire.router.choice import Choice
from kvwire.router.dispatch import Dispatcher
from kvwire.router.generation import Generation
from kvwire.router.sampling import Plan


class _Directory:
    def __init__(self, nodes: list[NodeInfo]):
        self.nodes = nodes

    def live_nodes(self, role: NodeRole | None = None, include_draining: bool = False) -> list[NodeInfo]:
        return [n for n in self.nodes if role is None or n.role == role]


def _node(node_id: str, role: NodeRole, endpoint: str, shares_prompts: bool) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, epoch=1, work_endpoint=endpoint, connector=ConnectorKind.TCP,
                    free_blocks=64, total_blocks=64, block_size=16, shares_prompts=shares_prompts)


async def _sent(shares_prompts: bool, prompts: list[list[int]] | None = None
                ) -> tuple[list[DecodeWork], list[PrefillWork], list[Choice]]:
    """What the nodes receive for 2 prompts (by default) x best_of 3, and the choices as the router recorded them."""
    ctx = zmq.asyncio.Context.instance()
    decode, prefill = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    d_port, p_port = decode.bind_to_random_port("tcp://127.0.0.1"), prefill.bind_to_random_port("tcp://127.0.0.1")
    nodes = [_node("p0", NodeRole.PREFILL, f"tcp://127.0.0.1:{p_port}", False),
             _node("d0", NodeRole.DECODE, f"tcp://127.0.0.1:{d_port}", shares_prompts)]
    dispatcher = Dispatcher(_Directory(nodes), "127.0.0.1")  # type: ignore[arg-type]
    plan = Plan(prompts=prompts or [[1] * 40, [2] * 30], n=2, best_of=3,
                sampling=SamplingParams(max_tokens=4, temperature=1.0, seed=7))
    gen = Generation(dispatcher, plan, "req", time.monotonic() + 10,
                     lambda k, rid, prompt: Choice(k, rid, prompt, plan, None))  # type: ignore[arg-type]
    try:
        await gen.start()
        works = [unpack(await asyncio.wait_for(decode.recv(), 5), expect=(DecodeWork,)) for _ in range(6)]
        prefills = []
        while await prefill.poll(200):
            prefills.append(unpack(await prefill.recv(), expect=(PrefillWork,)))
        return works, prefills, gen.choices  # type: ignore[return-value]
    finally:
        gen.close()
        await dispatcher.close()
        decode.close(0)
        prefill.close(0)


def test_later_choices_start_from_their_first_choices_prompt_on_its_decode_node():
    works, prefills, choices = asyncio.run(_sent(shares_prompts=True))
    assert [p.request_id for p in prefills] == ["req-0", "req-3"]  # each prompt prefilled once
    assert [(w.request_id, w.prefill_node, w.prompt_of, w.path_reason) for w in works] == [
        ("req-0", "p0", "", PathReason.PREFILLED),
        ("req-1", "", "req-0", PathReason.PROMPT_SHARED), ("req-2", "", "req-0", PathReason.PROMPT_SHARED),
        ("req-3", "p0", "", PathReason.PREFILLED),
        ("req-4", "", "req-3", PathReason.PROMPT_SHARED), ("req-5", "", "req-3", PathReason.PROMPT_SHARED)]
    assert [w.sampling.seed for w in works] == [7, 8, 9, 7, 8, 9]  # choice j of a prompt: seed + j
    assert [w.prompt_token_ids == [1] * 40 for w in works] == [True] * 3 + [False] * 3
    assert [(c.path, c.reason) for c in choices][:2] == [
        (ProxyPath.DISAGGREGATED, PathReason.PREFILLED), (ProxyPath.DECODE_ONLY, PathReason.PROMPT_SHARED)]


def test_a_decode_node_that_does_not_share_prompts_gets_every_choice_prefilled():
    works, prefills, _ = asyncio.run(_sent(shares_prompts=False))
    assert len(prefills) == 6
    assert {(w.prompt_of, w.path_reason) for w in works} == {("", PathReason.PREFILLED)}


def test_a_batchs_repeated_prompt_starts_from_its_first_occurrence():
    works, prefills, _ = asyncio.run(_sent(shares_prompts=True, prompts=[[3] * 40, [3] * 40]))
    assert [p.request_id for p in prefills] == ["req-0"]
    assert [(w.prefill_node, w.prompt_of) for w in works] == [("p0", "")] + [("", "req-0")] * 5


def test_a_prompts_prefill_is_sent_after_its_later_choices_reached_its_decode_node(monkeypatch):
    """Were it sent first, a busy router could send a later choice after the first one's prompt was done on the
    decode node (seen under load: it then computed its prompt itself). Sent last, it cannot be."""
    order: list[tuple[str, str]] = []
    push = Dispatcher._push

    async def recorded(self, node, msg):
        order.append((type(msg).__name__, msg.request_id))
        await push(self, node, msg)

    monkeypatch.setattr(Dispatcher, "_push", recorded)
    asyncio.run(_sent(shares_prompts=True))
    assert order == [("DecodeWork", f"req-{k}") for k in range(6)] + [("PrefillWork", "req-0"),
                                                                      ("PrefillWork", "req-3")]
