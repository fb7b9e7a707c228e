"""A real decode node, in process, given a request's later choices (`DecodeWork.prompt_of`): they start from the
first choice's prompt KV, whether it came from a prefill node or (here: its KV never came) was recomputed, and
answer as the single-process engine does; one whose first choice is not there, or is past its prompt, computes
the prompt itself and is counted as `prompt_not_shared`; nothing else is counted, and every block comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import zmq

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.control.framing import pack, unpack
from kvwire.decode_node.server import DecodeNode
from kvwire.engine.engine_config import EngineConfig
from kvwire.engine.reference import generate
from kvwire.node.config import NodeConfig
from kvwire.observability.labels import PathReason, RecomputeReason
from kvwire.protocol.work import DecodeWork, ErrorKind, SamplingParams, TokenChunk, WorkError

NUM_BLOCKS = 64
PROMPT = list(b"Disaggregated serving moves the prompt's KV once, then forks")  # 60 tokens: a partial last block
OTHER = list(b"Another prompt, not shared")


class Serving(NamedTuple):
    node: DecodeNode
    stop: threading.Event  # set it, then `node.wake()`: the node drains


@pytest.fixture
def serving(request, tiny_model_dir, redis_url) -> Iterator[Serving]:
    """A decode node serving in a thread; its KV deadline is the test's parameter (0.3 s unless given)."""
    deadline_s = getattr(request, "param", 0.3)
    config = NodeConfig(engine=EngineConfig(model_dir=tiny_model_dir, block_size=16, num_blocks=NUM_BLOCKS),
                        connector=ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.DECODE, node_id="decode-s",
                                                  redis_url=redis_url, kv_deadline_s=deadline_s))
    node = DecodeNode(config)
    stop = threading.Event()
    thread = threading.Thread(target=node.serve, args=(stop,), daemon=True)
    thread.start()
    yield Serving(node, stop)
    stop.set()
    node.wake()
    thread.join(10)
    node.close()


@pytest.fixture
def node(serving: Serving) -> DecodeNode:
    return serving.node


def _sampling(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=1.0, seed=seed, ignore_eos=True)


def _recomputes(node: DecodeNode, reason: RecomputeReason) -> float:
    return node.rt.metrics.recomputes.labels(str(reason))._value.get()


def test_later_choices_share_their_first_choices_prompt_and_the_rest_is_counted(node, tiny_model_dir):
    ctx = zmq.Context.instance()
    replies, work = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    reply_to = f"tcp://127.0.0.1:{replies.bind_to_random_port('tcp://127.0.0.1')}"
    work.connect(node.rt.work_endpoint)

    def send(rid: str, prompt: list[int], seed: int, prefill_node: str = "", prompt_of: str = "",
             reason: PathReason = PathReason.PREFILLED) -> None:
        work.send(pack(DecodeWork(request_id=rid, prompt_token_ids=prompt, sampling=_sampling(seed),
                                  prefill_node=prefill_node, reply_to=reply_to, path_reason=reason,
                                  prompt_of=prompt_of)))

    def answers(rids: set[str]) -> dict[str, TokenChunk]:
        tokens: dict[str, list[int]] = {}
        last: dict[str, TokenChunk] = {}
        while set(last) != rids:
            msg = unpack(replies.recv(), expect=(TokenChunk, WorkError))
            assert isinstance(msg, TokenChunk), msg
            tokens.setdefault(msg.request_id, []).extend(msg.token_ids)
            if msg.finished:
                last[msg.request_id] = msg
        return {rid: TokenChunk(request_id=rid, token_ids=tokens[rid], finished=True, stats=last[rid].stats)
                for rid in rids}

    before = {r: _recomputes(node, r) for r in RecomputeReason}  # the process's registry: other tests' too
    try:
        # a's KV never comes (no such prefill node): recomputed after the deadline; a-1, a-2 start from it
        send("a", PROMPT, 3, prefill_node="prefill-nowhere")
        for k in (1, 2):
            send(f"a-{k}", PROMPT, 3 + k, prompt_of="a", reason=PathReason.PROMPT_SHARED)
        send("lost", OTHER, 1, prompt_of="nobody", reason=PathReason.PROMPT_SHARED)  # its first one is not here
        got = answers({"a", "a-1", "a-2", "lost"})
        send("late", PROMPT, 5, prompt_of="a", reason=PathReason.PROMPT_SHARED)  # a has finished
        got |= answers({"late"})
        for rid, prompt, seed in (("a", PROMPT, 3), ("a-1", PROMPT, 4), ("a-2", PROMPT, 5), ("lost", OTHER, 1),
                                  ("late", PROMPT, 5)):
            assert got[rid].token_ids == generate(tiny_model_dir, [prompt], _sampling(seed))[0], rid
        assert got["a"].stats.transfer_failure is not None  # type: ignore[union-attr]
        assert all(not got[r].stats.bypassed and got[r].stats.kv_bytes == 0  # type: ignore[union-attr]
                   for r in got)
        counted = {r: _recomputes(node, r) - before[r] for r in RecomputeReason}
        assert counted == {**dict.fromkeys(RecomputeReason, 0), RecomputeReason.KV_NOT_RECEIVED: 1,  # a, once
                           RecomputeReason.PROMPT_NOT_SHARED: 2}, counted  # lost, late
        deadline = time.monotonic() + 10
        while node.engine.has_unfinished() or node.rt.allocator.num_free != NUM_BLOCKS:
            assert time.monotonic() < deadline, "blocks not freed"
            time.sleep(0.01)  # another thread's state
    finally:
        replies.close(0)
        work.close(0)


@pytest.mark.parametrize("serving", [1.5], indirect=True)  # the first choice still awaits its KV when the rest come
def test_a_draining_node_takes_a_later_choice_of_a_request_it_holds(serving: Serving, tiny_model_dir):
    """It finishes what it holds: a later choice of a request here is part of it (anything else is turned away:
    with no other decode node, answered DRAINING)."""
    node = serving.node
    ctx = zmq.Context.instance()
    replies, work = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    reply_to = f"tcp://127.0.0.1:{replies.bind_to_random_port('tcp://127.0.0.1')}"
    work.connect(node.rt.work_endpoint)
    try:
        work.send(pack(DecodeWork(request_id="a", prompt_token_ids=PROMPT, sampling=_sampling(3),
                                  prefill_node="prefill-nowhere", reply_to=reply_to)))
        deadline = time.monotonic() + 10
        while "a" not in node._awaiting_kv:
            assert time.monotonic() < deadline, "the first choice never arrived"
            time.sleep(0.005)  # another thread's state
        before = _recomputes(node, RecomputeReason.PROMPT_NOT_SHARED)
        serving.stop.set()
        node.wake()
        while not node._drain.active:
            assert time.monotonic() < deadline, "the node never began to drain"
            time.sleep(0.005)  # another thread's state
        for rid, prompt_of in (("a-1", "a"), ("other", "")):
            work.send(pack(DecodeWork(request_id=rid, prompt_token_ids=PROMPT, sampling=_sampling(4),
                                      prefill_node="", reply_to=reply_to, prompt_of=prompt_of,
                                      path_reason=PathReason.PROMPT_SHARED if prompt_of else PathReason.NOT_ASKED)))
        finished: dict[str, TokenChunk | WorkError] = {}
        while set(finished) != {"a", "a-1", "other"}:
            msg = unpack(replies.recv(), expect=(TokenChunk, WorkError))
            if isinstance(msg, WorkError) or msg.finished:
                finished[msg.request_id] = msg
        assert isinstance(finished["other"], WorkError) and finished["other"].kind == ErrorKind.DRAINING
        later = finished["a-1"]
        assert isinstance(later, TokenChunk) and later.stats is not None and later.stats.transfer_failure is None
        assert _recomputes(node, RecomputeReason.PROMPT_NOT_SHARED) == before
    finally:
        replies.close(0)
        work.close(0)
