"""Single-process generation: the same engine with no connector, the reference outputs
that the disaggregated path must reproduce token for token."""

from __future__ import annotations

import uuid
from pathlib import Path

from kvwire.connectors.kv_pool import KVPool
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner
from kvwire.engine.sequence import Sequence
from kvwire.protocol.work import SamplingParams, TokenLogprobs


def generate(model_dir: Path, prompts: list[list[int]], params: SamplingParams, *,
             block_size: int = 16, num_blocks: int = 1024, device: str = "cpu") -> list[list[int]]:
    """Generate completions for token-id prompts in one process, all batched together.

    Returns:
        The sampled token ids of each prompt, in order.
    """
    return [s.output_ids for s in _run(model_dir, prompts, params, block_size, num_blocks, device)]


def generate_with_logprobs(model_dir: Path, prompts: list[list[int]], params: SamplingParams, *,
                           block_size: int = 16, num_blocks: int = 1024,
                           device: str = "cpu") -> list[tuple[list[int], list[TokenLogprobs]]]:
    """As `generate`, with each token's logprobs (params.logprobs must be set for there to be any).

    Returns:
        Each prompt's sampled token ids and their logprobs (one per token, or none), in order.
    """
    return [(s.output_ids, s.logprobs) for s in _run(model_dir, prompts, params, block_size, num_blocks, device)]


def _run(model_dir: Path, prompts: list[list[int]], params: SamplingParams, block_size: int, num_blocks: int,
         device: str) -> list[Sequence]:
    model = load_model(model_dir, device)
    pool = KVPool.allocate(kv_layout(model.config, block_size), num_blocks, device)
    engine = LLMEngine(ModelRunner(model, pool), BlockAllocator(num_blocks),
                       model.config.max_position_embeddings, model.config.eos_token_id)
    seqs = [engine.add_request(f"ref-{uuid.uuid4().hex[:8]}-{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return seqs
