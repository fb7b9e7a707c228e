"""A request's later choices (n > 1, best_of) that start from its first choice's prompt KV instead of computing
or receiving the same prompt again, as vLLM forks a request's sequences from one prefill.

A later choice here (its `Sequence`, with the first choice's request id as its *leader*):

1. `add(seq, leader)`: it waits for its leader's prompt (the engine's caller checked that the leader's
   prompt is not done yet: `LLMEngine.prompt_pending`).
2. `prompt_done(leader, logits)`: the leader's prompt KV is written (computed or received) and its first-token
   logits are known. Each of its later choices takes one more use of every prompt block of the leader (they
   stay whatever the leader does next) and keeps the logits: it is `ready`.
3. The engine starts a ready one once its own blocks fit (`LLMEngine._start_shared`): the leader's full prompt
   blocks, shared; fresh ones for the rest, the first a copy of the leader's partial last prompt block (the
   leader writes its own tokens into its own); its first token is sampled from the leader's logits with its
   own generator, and it runs as any other request.
4. A leader that ends before its prompt is done (aborted) leaves its later choices to compute the prompt
   themselves (`orphans`). A later choice aborted on the way gives back what it took.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.sequence import Sequence


@dataclass(eq=False)
class ReadyChoice:
    """A later choice whose leader's prompt is done, waiting for its own blocks."""

    seq: Sequence
    prompt_blocks: list[int]  # the leader's prompt blocks, each used once more for this choice
    logits: torch.Tensor  # [vocab] float32: the leader's first-token logits
    bypassed: bool  # the leader's prompt KV was received, not computed


class SharedPrompts:
    """Owned by the engine (engine/llm_engine.py): its thread only, but `len()`, which any thread may read."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self._allocator, self._block_size = allocator, block_size
        self._waiting: dict[str, list[Sequence]] = {}  # leader's request id -> its later choices
        self.ready: deque[ReadyChoice] = deque()
        self._count = 0  # later choices not started yet, waiting or ready (an int: read from any thread)

    def __len__(self) -> int:
        return self._count

    def add(self, seq: Sequence, leader: str) -> None:
        self._waiting.setdefault(leader, []).append(seq)
        self._count += 1

    def started(self) -> ReadyChoice:
        """The first ready choice, which the engine starts now."""
        self._count -= 1
        return self.ready.popleft()

    def has_choices(self, leader: str) -> bool:
        return leader in self._waiting

    def prompt_done(self, leader: Sequence, logits: torch.Tensor) -> None:
        """`leader`'s prompt KV is written and `logits` (`[vocab]`) are its first token's: its later choices are
        ready, each holding the leader's prompt blocks."""
        later = self._waiting.pop(leader.request_id, [])
        blocks = leader.block_ids[:math.ceil(len(leader.prompt_ids) / self._block_size)]
        for seq in later:
            self._allocator.retain(blocks)
            self.ready.append(ReadyChoice(seq, blocks, logits, leader.bypassed))

    def orphans(self, leader: str) -> list[Sequence]:
        """The later choices of a leader that ended before its prompt was done (they compute it themselves)."""
        later = self._waiting.pop(leader, [])
        self._count -= len(later)
        return later

    def abort(self, request_id: str) -> bool:
        """Drop a later choice not started yet, giving back the leader's blocks it held. Whether it was one."""
        for leader, later in list(self._waiting.items()):
            kept = [s for s in later if s.request_id != request_id]
            if len(kept) != len(later):
                self._waiting[leader] = kept
                if not kept:
                    del self._waiting[leader]
                self._count -= 1
                return True
        for ready in self.ready:
            if ready.seq.request_id == request_id:
                self.ready.remove(ready)
                self._allocator.free(ready.prompt_blocks)
                self._count -= 1
                return True
        return False

    @property
    def sequences(self) -> list[Sequence]:
        """Every later choice not started yet."""
        return [s for later in self._waiting.values() for s in later] + [r.seq for r in self.ready]
