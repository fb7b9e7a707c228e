"""`kvwire bench handoff`: what taking turns with another process costs a prompt forward, with no kvwire in between.

Disaggregated on one host, the prefill process computes a prompt after sitting idle while the
decode process generated the previous request's tokens; single-node, the process that computes
the prompt is the one that just ran. This measures that difference alone: two processes, each
with the same engine and model (no connector, no directory, no network), and for each
measured prompt the previous request (its prompt and decode steps) was served either by the
same process or by the other one, alternating. It times the prompt's engine step, in the
process that computes it. `kvwire bench e2e` shows the same difference between its two nodes,
with the transfer and everything else on top.

Lifecycle of `bench_handoff`:

1. Spawn the two engine processes.
2. Run the rounds over a pipe each.
3. Stop them.
"""

from __future__ import annotations

import contextlib
import random
import statistics
from pathlib import Path

import msgspec

from kvwire.bench.procs import helper_context

DECODE_STEPS = 16  # tokens the previous request generates, as in `kvwire bench e2e`


class HandoffResult(msgspec.Struct, frozen=True):
    tokens: int  # prompt length
    rounds: int  # measured prompts per case
    after_itself_ms_p50: float  # the computing process served the previous request (single-node)
    after_other_ms_p50: float  # the other process served it, this one sat idle (disaggregated)
    ratio: float  # after_other / after_itself


def _engine_process(model_dir: Path, num_blocks: int, pipe) -> None:
    """Serve (prompt length, max tokens) requests; answer each with the seconds of its prompt step."""
    import time

    import torch

    from kvwire.connectors.kv_pool import KVPool
    from kvwire.engine.block_allocator import BlockAllocator
    from kvwire.engine.gc_pauses import freeze_startup_heap
    from kvwire.engine.llm_engine import LLMEngine
    from kvwire.engine.loader import load_model
    from kvwire.engine.model_config import kv_layout
    from kvwire.engine.runner import ModelRunner
    from kvwire.protocol.work import SamplingParams

    torch.set_num_threads(1)  # as nodes run (--torch-threads 1)
    model = load_model(model_dir, "cpu")
    pool = KVPool.allocate(kv_layout(model.config, 16), num_blocks, "cpu")
    engine = LLMEngine(ModelRunner(model, pool), BlockAllocator(num_blocks), model.config.max_position_embeddings,
                       model.config.eos_token_id)
    freeze_startup_heap()
    rng, n = random.Random(0), 0
    pipe.send("up")
    while (ask := pipe.recv()) is not None:
        tokens, max_tokens = ask
        n += 1
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(tokens)]
        engine.add_request(f"handoff-{n}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        start = time.perf_counter()
        engine.step()  # the prompt's step: its forward and first token
        first = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        pipe.send(first)


def demo_prompt_lengths(model_dir: Path) -> list[int]:
    """The token counts of the demo's prompts (what `kvwire bench e2e` sends) under the model's tokenizer."""
    from kvwire.bench.prompts import PROMPTS
    from kvwire.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [max(1, len(tokenizer.encode(p))) for p in PROMPTS]


def bench_handoff(model_dir: Path, tokens: list[int], rounds: int) -> list[HandoffResult]:
    ctx = helper_context()
    blocks = 2 * (max(tokens) + DECODE_STEPS) // 16 + 8
    pipes, procs = [], []
    for _ in range(2):
        here, there = ctx.Pipe()
        procs.append(ctx.Process(target=_engine_process, args=(model_dir, blocks, there), daemon=True))
        procs[-1].start()
        pipes.append(here)
    try:
        for p in pipes:
            if not p.poll(120) or p.recv() != "up":
                raise RuntimeError("an engine process did not start")
        return [_measure(pipes, n, rounds) for n in tokens]
    finally:
        for p in pipes:
            with contextlib.suppress(OSError):  # a process that died has no pipe left to tell
                p.send(None)
        for proc in procs:
            proc.join(30)
            proc.kill()


def _measure(pipes, tokens: int, rounds: int) -> HandoffResult:
    computing, other = pipes
    times: dict[bool, list[float]] = {True: [], False: []}  # after itself?

    def ask(pipe, max_tokens: int) -> float:
        pipe.send((tokens, max_tokens))
        return pipe.recv()

    ask(computing, DECODE_STEPS)  # warm-up
    for r in range(rounds):
        for itself in ((True, False) if r % 2 else (False, True)):
            ask(computing if itself else other, DECODE_STEPS)  # the previous request, prompt and decode
            times[itself].append(ask(computing, 1))  # the measured prompt
    a, b = statistics.median(times[True]), statistics.median(times[False])
    return HandoffResult(tokens=tokens, rounds=rounds, after_itself_ms_p50=round(a * 1e3, 3),
                         after_other_ms_p50=round(b * 1e3, 3), ratio=round(b / a, 3))
