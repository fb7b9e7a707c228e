"""vLLM's KV cache groups: which blocks of each group a request's transfer moves.

With vLLM's hybrid KV cache manager (kvwire is `SupportsHMA`), a model whose layers attend
differently (Gemma 3 and gpt-oss: sliding-window layers beside full ones) has one KV cache group
per kind of layer (and more of equal size), each with its own block list per request, all drawn
from one pool: the i-th layer of every group views the same tensor (`kv_cache_tensors`), so a
block id names the same bytes whatever group holds it. A request's KV is therefore one list of
blocks of those shared planes, and one pull moves it:

- A full-attention group moves every block of the prompt.
- A sliding-window group of window `w` only the blocks holding the prompt's last `w` tokens and
  one more (the consumer recomputes the prompt's last token, whose window reaches one token
  further back). The prefill server may already have freed the blocks before them (vLLM puts its
  null block, id 0, in their place); the decode server allocates none for them.

`Groups.held` (producer) lists each group's moved blocks, group after group; `Groups.pull`
(consumer) lists its own the same way, with the positions it lacks (its prefix cache may hold the
rest). The two lists pair position by position, the producer's length checked by the consumer.

Refused at start-up (`Groups.of`): Mamba / linear-attention state, chunked-local and other
attention kinds, groups of unlike block sizes, groups vLLM does not transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0  # vLLM's null block (vllm.v1.attention.backends.utils.NULL_BLOCK_ID): never moved into


@dataclass(frozen=True)
class Groups:
    """The transfer-relevant shape of vLLM's KV cache groups."""

    windows: tuple[int, ...]  # per group: its sliding window in tokens, 0 for full attention
    block_size: int
    layers: tuple[tuple[str, ...], ...]  # per group: its layers' names, in vLLM's order

    @classmethod
    def of(cls, config: KVCacheConfig) -> Groups:
        """Raises ValueError for groups kvwire does not move (module docstring), naming them."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

        groups = config.kv_cache_groups
        if len(config.transfer_group_ids) != len(groups):
            raise ValueError(f"vLLM transfers KV cache groups {config.transfer_group_ids} of {len(groups)}; "
                             "kvwire moves models whose every group is transferred")
        windows = []
        for group in groups:
            spec = group.kv_cache_spec
            if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
                windows.append(0)
            elif type(spec) is SlidingWindowSpec:
                windows.append(spec.sliding_window)
            else:
                raise ValueError(f"kvwire moves full and sliding-window attention KV; layers "
                                 f"{list(group.layer_names)[:3]} cache {type(spec).__name__} (Mamba and linear "
                                 "attention state, chunked-local attention and the like are not moved): serve "
                                 "this model without a KV connector")
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"kvwire moves KV cache groups of one block size; these have {sorted(sizes)}")
        return cls(tuple(windows), sizes.pop(), tuple(tuple(g.layer_names) for g in groups))

    def first_needed(self, group: int, num_tokens: int) -> int:
        """The first block of `group` a consumer needs for a prompt of `num_tokens` (module docstring)."""
        window = self.windows[group]
        return max(0, num_tokens - window) // self.block_size if window else 0

    def held(self, block_ids: tuple[list[int], ...] | list[list[int]], num_tokens: int) -> list[int]:
        """Producer: the blocks a consumer may pull, group after group.

        Raises:
            ValueError: a needed block was freed already (the prefill request decoded past its window:
                a P/D proxy sends it with max_tokens 1).
        """
        n = math.ceil(num_tokens / self.block_size)
        out: list[int] = []
        for g, blocks in enumerate(block_ids):
            needed = list(blocks[self.first_needed(g, num_tokens):n])
            if NULL_BLOCK in needed:
                raise ValueError(f"blocks of the last {self.windows[g]} tokens of the prompt are freed already "
                                 "(its prefill decoded past them: send prefill requests with max_tokens 1)")
            out += needed
        return out

    def pull(self, block_ids: tuple[list[int], ...] | list[list[int]], num_tokens: int,
             first_block: int) -> tuple[list[int], list[int]]:
        """Consumer: `(blocks, pick)`, its blocks paired with `held`'s list and the positions to pull: those
        from `first_block` on (the ones before are in its prefix cache) that vLLM allocated."""
        n = math.ceil(num_tokens / self.block_size)
        blocks: list[int] = []
        pick: list[int] = []
        for g, ids in enumerate(block_ids):
            start = self.first_needed(g, num_tokens)
            for b in range(start, n):
                block = ids[b] if b < len(ids) else NULL_BLOCK
                if b >= first_block and block != NULL_BLOCK:
                    pick.append(len(blocks))
                blocks.append(block)
        return blocks, pick

    def planes(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors every group's blocks live in: one per layer position of the largest group, by the name
        of that group's layer there.

        Raises:
            ValueError: a group's layer that does not view the same tensor as the others at its position.
        """
        widest = max(self.layers, key=len)
        planes = {name: kv_caches[name] for name in widest}
        tensors = list(planes.values())
        for names in self.layers:
            for i, name in enumerate(names):
                t, plane = kv_caches[name], tensors[i]
                if (t.data_ptr(), t.shape, t.stride()) != (plane.data_ptr(), plane.shape, plane.stride()):
                    raise ValueError(f"layer {name}'s KV tensor is not the one layer {widest[i]} views; kvwire "
                                     "moves KV cache groups that share their tensors (vLLM's hybrid allocator)")
        return planes
