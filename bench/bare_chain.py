"""The bare chain: `kvwire bench e2e`'s two modes with no kvwire in them, as a baseline for the TTFT gap.

What disaggregation costs on a host before any transfer plane is involved: one more process on the
first token's path (client -> prefill -> decode -> client, against client -> decode -> client), and
a prompt forward computed in a process that sat idle while the other generated the previous
request's tokens. Here two engine processes (the nodes' engine, model and thread count) talk over
zmq on loopback, as kvwire's nodes do, with nothing else: no router, no directory, no connector.
Disaggregated, the prefill process computes the prompt and puts the last prompt row of its hidden
states in its message to the decode process, which samples the first token from it and then decodes
over KV blocks it never received (the bytes in them are whatever the pool held): the same work as a
decode node after a transfer that took no time, whose tokens are not meant to be read. Single-node,
the decode process computes the prompt itself. The client times each request's first token.

Lifecycle of `bench_bare_chain`:

1. Spawn the decode process, then the prefill process (it learns the decode process's endpoint).
2. Send the prompts one at a time, `rounds` times, each prompt in both modes, the order alternating
   between rounds as in `kvwire bench e2e`.
3. Tell both processes to stop, and join them.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import msgspec
import torch
import zmq

from kvwire.bench.procs import helper_context
from kvwire.connectors.base import KVConnectorBase

DECODE_HOST = "127.0.0.1"


class Compute(msgspec.Struct, tag=True, frozen=True):
    """To the decode process: compute this prompt yourself (single-node)."""
    rid: str
    prompt: list[int]
    max_tokens: int


class Prefill(msgspec.Struct, tag=True, frozen=True):
    """To the prefill process: compute this prompt and hand it to the decode process (disaggregated)."""
    rid: str
    prompt: list[int]
    max_tokens: int


class Handoff(msgspec.Struct, tag=True, frozen=True):
    """Prefill to decode: the prompt and its last hidden row (float32 bytes)."""
    rid: str
    prompt: list[int]
    max_tokens: int
    last_row: bytes


class FirstToken(msgspec.Struct, tag=True, frozen=True):
    rid: str
    token: int


class Finished(msgspec.Struct, tag=True, frozen=True):
    rid: str


class Stop(msgspec.Struct, tag=True, frozen=True):
    pass


Message = Compute | Prefill | Handoff | FirstToken | Finished | Stop
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


class _RowGiven(KVConnectorBase):
    """The decode process's receive: the hidden row the prefill process sent, no KV (bypass)."""

    def __init__(self) -> None:  # noqa: D107 - no rank, no config: nothing travels through it
        self.rows: dict[str, torch.Tensor] = {}  # request id -> [hidden]

    def close(self) -> None:
        self.rows.clear()

    def send_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches, hidden) -> None:
        raise NotImplementedError("the bare chain's decode process sends nothing")

    def recv_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches):
        row = self.rows.pop(model_input.request_ids[0])
        return row.expand(model_input.num_tokens, -1), True, model_input  # [num_tokens, hidden]: only the last is read


def _engine(model_dir: Path, num_blocks: int, connector: KVConnectorBase | None):
    """`(engine, runner)`: the runner receives from `connector` (None: computes every prompt)."""
    from kvwire.connectors.kv_pool import KVPool
    from kvwire.engine.block_allocator import BlockAllocator
    from kvwire.engine.gc_pauses import freeze_startup_heap
    from kvwire.engine.llm_engine import LLMEngine
    from kvwire.engine.loader import load_model
    from kvwire.engine.model_config import kv_layout
    from kvwire.engine.runner import ModelRunner

    torch.set_num_threads(1)  # as nodes run (--torch-threads 1)
    model = load_model(model_dir, "cpu")
    pool = KVPool.allocate(kv_layout(model.config, 16), num_blocks, "cpu")
    runner = ModelRunner(model, pool, consumer=connector)
    engine = LLMEngine(runner, BlockAllocator(num_blocks), model.config.max_position_embeddings,
                       model.config.eos_token_id)
    freeze_startup_heap()
    return engine, runner


def _decode_process(model_dir: Path, num_blocks: int, client: str, pipe) -> None:
    """Serve Compute and Handoff messages: the first token to the client at once, Finished at the end."""
    from kvwire.connectors.kv_pool import TORCH_DTYPES
    from kvwire.protocol.work import SamplingParams

    given = _RowGiven()
    engine, runner = _engine(model_dir, num_blocks, given)
    dtype = TORCH_DTYPES[runner.model.config.dtype]
    ctx = zmq.Context()
    inbox, reply = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pipe.send(f"tcp://{DECODE_HOST}:{inbox.bind_to_random_port(f'tcp://{DECODE_HOST}')}")
    reply.connect(client)
    while not isinstance(msg := _decoder.decode(inbox.recv()), Stop):
        assert isinstance(msg, Compute | Handoff)
        params = SamplingParams(max_tokens=msg.max_tokens, temperature=0.0, ignore_eos=True)
        if isinstance(msg, Handoff):
            given.rows[msg.rid] = torch.frombuffer(bytearray(msg.last_row), dtype=torch.float32).to(dtype)
        engine.add_request(msg.rid, msg.prompt, params, receive_kv=isinstance(msg, Handoff))
        first = True
        while engine.has_unfinished():
            for out in engine.step():
                if first and out.new_token_ids:
                    reply.send(_encoder.encode(FirstToken(msg.rid, out.new_token_ids[0])))
                    first = False
            engine.after_step()
        reply.send(_encoder.encode(Finished(msg.rid)))
    ctx.destroy(linger=0)


def _prefill_process(model_dir: Path, num_blocks: int, decode: str, pipe) -> None:
    """Serve Prefill messages: compute the prompt, send its last hidden row on to the decode process."""
    from kvwire.connectors.model_input import ModelInput, SequenceInput

    engine, runner = _engine(model_dir, num_blocks, None)
    ctx = zmq.Context()
    inbox, onward = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pipe.send(f"tcp://{DECODE_HOST}:{inbox.bind_to_random_port(f'tcp://{DECODE_HOST}')}")
    onward.connect(decode)
    while not isinstance(msg := _decoder.decode(inbox.recv()), Stop):
        assert isinstance(msg, Prefill)
        blocks = engine.allocator.allocate(-(-len(msg.prompt) // engine.block_size))
        try:
            result = runner.run_prompt(ModelInput([SequenceInput(msg.rid, msg.prompt, 0, blocks)]))
        finally:
            engine.allocator.free(blocks)
        row = result.last_hidden[0].float().contiguous()  # [hidden]
        onward.send(_encoder.encode(Handoff(msg.rid, msg.prompt, msg.max_tokens, row.numpy().tobytes())))
    ctx.destroy(linger=0)


class BareChain:
    """The two processes and the client's sockets; `ask` times one request's first token (one at a time)."""

    def __init__(self, model_dir: Path, num_blocks: int):
        self._mp = helper_context()
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        client = f"tcp://{DECODE_HOST}:{self._replies.bind_to_random_port(f'tcp://{DECODE_HOST}')}"
        self._procs: list = []
        self._to: dict[str, zmq.Socket] = {}
        try:
            decode = self._spawn("decode", _decode_process, model_dir, num_blocks, client)
            self._spawn("prefill", _prefill_process, model_dir, num_blocks, decode)
        except BaseException:
            self.close()
            raise
        self._n = 0

    def _spawn(self, name: str, target, *args) -> str:
        here, there = self._mp.Pipe()
        proc = self._mp.Process(target=target, args=(*args, there), daemon=True, name=f"bare-{name}")
        proc.start()
        self._procs.append(proc)
        deadline = time.monotonic() + 120
        while not here.poll(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the bare chain's {name} process did not start (exit code {proc.exitcode})")
        endpoint = here.recv()
        self._to[name] = sock = self._ctx.socket(zmq.PUSH)
        sock.connect(endpoint)
        return endpoint

    def ask(self, prompt: list[int], max_tokens: int, disaggregated: bool) -> tuple[float, int]:
        """One request, to its end; returns the milliseconds from sending it to its first token, and that
        token (greedy: the same in both modes, the only one of a disaggregated request computed from KV)."""
        self._n += 1
        rid = f"bare-{self._n}"
        msg = Prefill(rid, prompt, max_tokens) if disaggregated else Compute(rid, prompt, max_tokens)
        start = time.perf_counter()
        self._to["prefill" if disaggregated else "decode"].send(_encoder.encode(msg))
        first = _decoder.decode(self._replies.recv())
        ttft = (time.perf_counter() - start) * 1e3
        done = _decoder.decode(self._replies.recv())
        assert isinstance(first, FirstToken) and first.rid == rid and isinstance(done, Finished), (first, done)
        return ttft, first.token

    def close(self) -> None:
        for sock in self._to.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.send(_encoder.encode(Stop()), zmq.NOBLOCK)
        for proc in self._procs:
            proc.join(30)
            proc.kill()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> BareChain:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
