"""Fixtures of the engine tests: one random tiny checkpoint per session and a paged runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.loader import load_model
from kvwire.engine.model import LlamaForCausalLM
from kvwire.engine.model_config import kv_layout

TINY_SEED = 0


class PagedRunner:
    """A model over its own KV pool, with helpers that build ModelInputs."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        self.pool = KVPool.allocate(kv_layout(model.config, block_size), num_blocks)
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, num_tokens: int) -> list[int]:
        return self.allocator.allocate(-(-num_tokens // self.block_size))

    def forward(self, *seqs: SequenceInput) -> torch.Tensor:
        """Runs one batch; returns `[num_tokens, hidden]`."""
        return self.model(ModelInput(list(seqs), is_prompt=seqs[0].start_pos == 0), self.pool.kv_caches)

    def logits(self, *seqs: SequenceInput) -> torch.Tensor:
        return self.model.compute_logits(self.forward(*seqs))

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation: a prompt step then single-token decode steps."""
        blocks = self.blocks_for(len(prompt) + max_tokens)
        ids, out = list(prompt), []
        logits = self.logits(SequenceInput("g", ids, 0, blocks))[-1]
        for _ in range(max_tokens):
            out.append(int(logits.argmax()))
            logits = self.logits(SequenceInput("g", [out[-1]], len(ids), blocks))[-1]
            ids.append(out[-1])
        self.allocator.free(blocks)
        return out


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir: Path) -> Path:
    """The suite's tiny checkpoint (tests/conftest.py), written with seed TINY_SEED."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> LlamaForCausalLM:
    return load_model(tiny_dir)


@pytest.fixture
def make_runner(tiny_model: LlamaForCausalLM):
    """`make_runner(num_blocks=64, block_size=4, model=tiny)`: a runner over a fresh pool."""

    def make(num_blocks: int = 64, block_size: int = 4, model: LlamaForCausalLM | None = None) -> PagedRunner:
        return PagedRunner(model or tiny_model, num_blocks, block_size)

    return make


@pytest.fixture
def runner(make_runner) -> PagedRunner:
    """The tiny model over a fresh pool of 64 blocks of 4 tokens."""
    return make_runner()
