"""Warm a node's engine before it serves: the first request must not pay the device's start-up.

On a GPU the first forward of a process pays CUDA's start-up (context, kernel modules loaded lazily, cuBLAS
handles, the caching allocator growing, pinned host memory) and torch's first-call costs, many times what the
request itself costs. vLLM runs a profile forward before it serves; a kvwire node does the same
(node/runtime.py: before it registers in the directory, so no router picks it cold).

A warm-up pass, on the node's device, in the node's own pool:

1. Takes a few blocks from the allocator (only plain free ones: it runs before the node serves, and is
   skipped when blocks are cached or too few are free), and keeps a copy of their bytes.
2. Computes a short dummy prompt through the model over the paged pool (the prompt step's shape), then a
   few decode steps (one new token each), projects to logits and samples greedily and at a temperature
   with top-k, top-p and logprobs (the sampler's paths).
3. Copies blocks within the pool with the transfer plane's gather/scatter (connectors/transports/
   block_copy.py, what a pull's copies launch), batched and run by run, and compiles the UCX packs'
   kernel (piece_copy.py) where Triton runs: the part of the transfer plane that needs no peer (the
   node's transport self-test already looped a transfer on the host).
4. Puts the blocks' bytes back and frees the blocks: the allocator and the pool are left exactly as they
   were. Nothing is named (no prefix-cache entry), no connector is called (nothing published, no pull),
   no metric is touched (it is no request).

Passes repeat while they keep getting faster, up to MAX_PASSES; no pass starts once `budget_s` has passed.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.transports import piece_copy
from kvwire.connectors.transports.block_copy import copy_blocks
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.runner import ModelRunner
from kvwire.engine.sampler import TokenHistory, make_generator, sample
from kvwire.protocol.work import SamplingParams

WARMUP_BUDGET_S = 60.0  # no pass starts after this; a cold GPU's first pass takes a second or two
MAX_PASSES = 3
CONVERGED = 1.5  # a pass not this many times faster than the one before it: warm, stop
DECODE_STEPS = 2
COPY_BLOCKS = 4  # two runs of one block each way: gather/scatter wants two runs or more
_SAMPLINGS = (SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.8, top_k=8, top_p=0.9,
                                                           min_p=0.01, repetition_penalty=1.1, seed=0, logprobs=2))


class WarmupReport(NamedTuple):
    """What a warm-up did: each pass's time, or why it did nothing."""

    pass_ms: tuple[float, ...]  # empty when skipped
    skipped: str = ""  # why nothing ran ("" when it ran)

    def describe(self) -> str:
        if self.skipped:
            return f"warm-up skipped: {self.skipped}"
        times = ", ".join(f"{ms:.1f}" for ms in self.pass_ms)
        return f"warm-up: {len(self.pass_ms)} pass{'es' if len(self.pass_ms) > 1 else ''} in {times} ms"


def warm_up(runner: ModelRunner, allocator: BlockAllocator, max_model_len: int,
            budget_s: float = WARMUP_BUDGET_S) -> WarmupReport:
    """Run warm-up passes (module docstring) through `runner`'s model and pool, with blocks of `allocator`.

    Args:
        runner: the node's runner (its model and pool on the node's device); its connector is not called.
        allocator: the pool's allocator; left exactly as it was.
        max_model_len: the node's longest sequence (the dummy prompt and its decode steps fit in it).
        budget_s: no pass starts after this many seconds (the first always runs).
    Returns:
        Each pass's time, or why none ran.
    Raises:
        Whatever the model raises: a node whose forward fails must not serve.
    """
    block_size = runner.pool.layout.block_size
    prompt_len = max(1, min(2 * block_size, max_model_len - DECODE_STEPS))
    steps = max(0, min(DECODE_STEPS, max_model_len - prompt_len))
    need = max(COPY_BLOCKS, math.ceil((prompt_len + steps) / block_size))
    if allocator.num_cached or need > allocator.num_free:
        return WarmupReport((), f"needs {need} free KV blocks and none cached; {allocator.num_free} free, "
                                f"{allocator.num_cached} cached")
    blocks = allocator.allocate(need)
    saved = runner.pool.data[blocks].clone()  # [need, ...]: the blocks' bytes, put back after
    try:
        return _passes(runner, blocks, prompt_len, steps, budget_s)
    finally:
        runner.pool.data[blocks] = saved
        _synchronize(runner.pool.data.device)
        allocator.free(blocks)


def _passes(runner: ModelRunner, blocks: list[int], prompt_len: int, steps: int, budget_s: float) -> WarmupReport:
    start = time.monotonic()
    times: list[float] = []
    while len(times) < MAX_PASSES:
        began = time.monotonic()
        _one_pass(runner, blocks, prompt_len, steps)
        times.append(round((time.monotonic() - began) * 1000, 2))
        if time.monotonic() - start >= budget_s or (len(times) > 1 and times[-1] >= times[-2] / CONVERGED):
            break
    return WarmupReport(tuple(times))


@torch.inference_mode()
def _one_pass(runner: ModelRunner, blocks: list[int], prompt_len: int, steps: int) -> None:
    vocab = runner.model.config.vocab_size
    prompt = [(i * 7919 + 1) % vocab for i in range(prompt_len)]  # any ids: a dummy prompt
    hidden = runner.model(ModelInput([SequenceInput("warmup", prompt, 0, blocks)]), runner.kv_caches)
    logits = runner.logits(hidden[-1:])  # [1, vocab]
    token = _sample(logits[0], prompt)
    for k in range(steps):
        batch = ModelInput([SequenceInput("warmup", [token], prompt_len + k, blocks)], is_prompt=False)
        token = _sample(runner.logits(runner.run_decode(batch))[0], prompt)
    planes = KVRegion.from_kv_caches(runner.kv_caches).planes
    a, b, c, d = blocks[:COPY_BLOCKS]
    for batched in (True, False):
        copy_blocks(planes, planes, [(a, c, 1), (b, d, 1)], batched=batched)
    piece_copy.warm(runner.pool.data.device)  # UCX's device packs (a layer-wise stream's per-layer pieces)
    _synchronize(runner.pool.data.device)


def _sample(logits: torch.Tensor, prompt: list[int]) -> int:
    """The sampler's greedy and random paths (with its penalties and logprobs); the greedy token."""
    tokens = []
    for params in _SAMPLINGS:
        history = TokenHistory.start(prompt, params, logits.numel())
        tokens.append(sample(logits, params, make_generator(params.seed), history).token)
    return tokens[0]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
