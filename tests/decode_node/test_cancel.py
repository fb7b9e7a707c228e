"""A real decode node, in process, told `CancelWork`: the request is dropped without a word more and its
blocks come back, whether it was decoding or still awaiting its KV; unknown ids are ignored. The same node
refuses bad sampling params as INVALID_REQUEST and streams logprobs in its `TokenChunk`s when asked."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.control.framing import pack, unpack
from kvwire.decode_node.server import DecodeNode
from kvwire.engine.engine_config import EngineConfig
from kvwire.node.config import NodeConfig
from kvwire.protocol.work import CancelWork, DecodeWork, ErrorKind, SamplingParams, TokenChunk, WorkError

NUM_BLOCKS = 64
PROMPT = [65, 66, 67]


@pytest.fixture
def node(tiny_model_dir, redis_url):
    config = NodeConfig(engine=EngineConfig(model_dir=tiny_model_dir, block_size=16, num_blocks=NUM_BLOCKS),
                        connector=ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.DECODE, node_id="decode-c",
                                                  redis_url=redis_url, kv_deadline_s=30.0))
    node = DecodeNode(config)
    stop = threading.Event()
    serving = threading.Thread(target=node.serve, args=(stop,), daemon=True)
    serving.start()
    yield node
    stop.set()
    node.wake()
    serving.join(10)
    node.close()


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)  # another thread's state: nothing to block on


def test_cancel_drops_running_and_awaiting_requests(node):  # one node start (~1 s) for all of it
    ctx = zmq.Context.instance()
    replies, work = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    reply_to = f"tcp://127.0.0.1:{replies.bind_to_random_port('tcp://127.0.0.1')}"
    work.connect(node.rt.work_endpoint)
    try:
        def send(rid: str, prefill_node: str = "", **sampling) -> None:
            work.send(pack(DecodeWork(request_id=rid, prompt_token_ids=PROMPT, sampling=SamplingParams(**sampling),
                                      prefill_node=prefill_node, reply_to=reply_to)))

        send("bad", top_k=-5)
        refused = unpack(replies.recv(), expect=(TokenChunk, WorkError))
        assert isinstance(refused, WorkError) and refused.kind == ErrorKind.INVALID_REQUEST
        assert "bad" in refused.reason and "top_k" in refused.reason
        send("long", max_tokens=1000, ignore_eos=True)  # decodes for a while
        send("awaiting", prefill_node="prefill-nowhere", max_tokens=4)  # its KV never comes
        first = unpack(replies.recv(), expect=(TokenChunk, WorkError))
        assert isinstance(first, TokenChunk) and first.request_id == "long" and not first.finished
        for rid in ("long", "awaiting", "unknown"):
            work.send(pack(CancelWork(request_id=rid)))
        send("after", max_tokens=3, logprobs=2)
        got: list = []
        while not (got and got[-1].request_id == "after" and got[-1].finished):
            got.append(unpack(replies.recv(), expect=(TokenChunk, WorkError)))
        after = [m for m in got if m.request_id == "after"]
        assert all(isinstance(m, TokenChunk) for m in got)
        assert not any(m.finished for m in got if m.request_id == "long")
        assert got.index(after[0]) >= len(got) - len(after)  # nothing for "long" once "after" started
        assert [len(m.logprobs) for m in after] == [len(m.token_ids) for m in after] == [1, 1, 1]
        assert all(m.logprobs[0].top_ids[0] == m.token_ids[0] for m in after)  # greedy: the most likely
        _wait(lambda: not node._requests and not node.engine.has_unfinished())
        assert node.rt.allocator.num_free == NUM_BLOCKS
        assert replies.poll(200) == 0  # and nothing more comes
    finally:
        replies.close(0)
        work.close(0)
