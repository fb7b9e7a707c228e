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

- A state group (Mamba, linear attention: vLLM's `MambaSpec`, e.g. Qwen3-Next's Gated DeltaNet)
  one block: the running state after the prompt's tokens, in the block vLLM's Mamba kernels read
  it from (the `ceil(tokens / state_block)`-th, in either `mamba_cache_mode`). A state is not a
  per-token tensor, so the consumer cannot compute the last token from the state after it: as in
  vLLM's NixlConnector, the producer computes all but the prompt's last token (`backoff`; the
  scheduler half drops it), the consumer loads that state and computes the last token itself.
  vLLM pads the state page to the attention page (and enlarges the attention block to match), so
  a state block is one page of the shared pool, moved whole: conv and SSM state together.

`Groups.held` (producer) lists each group's moved blocks, group after group; `Groups.pull`
(consumer) lists its own the same way, with the positions it lacks (its prefix cache may hold the
rest). The two lists pair position by position, the producer's length checked by the consumer.

Refused at start-up (`Groups.of`): chunked-local and other attention kinds, attention groups of
unlike block sizes, models with no attention group, speculative decoding's scratch state blocks,
groups vLLM does not transfer; and by the connector, state groups with more than one rank (a
tensor-parallel state splits inside the page).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

NULL_BLOCK = 0  # vLLM's null block (vllm.v1.attention.backends.utils.NULL_BLOCK_ID): never moved into


@dataclass(frozen=True)
class Groups:
    """The transfer-relevant shape of vLLM's KV cache groups."""

    windows: tuple[int, ...]  # per group: its sliding window in tokens, 0 for full attention (and state)
    block_size: int  # the attention groups' (tokens per block)
    layers: tuple[tuple[str, ...], ...]  # per group: its layers' names, in vLLM's order
    states: tuple[int, ...] = ()  # per group: a state group's tokens per state block, 0 for attention; () none

    @property
    def backoff(self) -> int:
        """Prompt tokens the producer leaves to the consumer: 1 with state groups (module docstring), else 0."""
        return 1 if any(self.states) else 0

    @classmethod
    def of(cls, config: KVCacheConfig) -> Groups:
        """Raises ValueError for groups kvwire does not move (module docstring), naming them."""
        groups = config.kv_cache_groups
        if len(config.transfer_group_ids) != len(groups):
            raise ValueError(f"vLLM transfers KV cache groups {config.transfer_group_ids} of {len(groups)}; "
                             "kvwire moves models whose every group is transferred")
        kinds = [_kind_of(group) for group in groups]
        windows = tuple(window for window, _ in kinds)
        states = tuple(state for _, state in kinds)
        sizes = {g.kv_cache_spec.block_size for g, state in zip(groups, states) if not state}
        if not sizes:
            raise ValueError("kvwire moves models with attention layers; this one caches state only")
        if len(sizes) != 1:
            raise ValueError(f"kvwire moves KV cache groups of one block size; these have {sorted(sizes)}")
        return cls(windows, sizes.pop(), tuple(tuple(g.layer_names) for g in groups),
                   states if any(states) else ())

    def check_ranks(self, tensor_parallel_size: int) -> None:
        """Raises ValueError for state groups over more than one tensor-parallel rank (each rank's state page
        holds its share of the conv and SSM state, split inside the page: not moved)."""
        if self.backoff and tensor_parallel_size > 1:
            raise ValueError(f"kvwire moves Mamba / linear-attention state at tensor-parallel size 1 only (each "
                             f"rank's state page splits inside); this server has {tensor_parallel_size}")

    def state_block(self, group: int, num_tokens: int) -> int | None:
        """The index of the block holding `group`'s state after `num_tokens` tokens; None for attention."""
        state = self.state_tokens(group)
        return max(0, math.ceil(num_tokens / state) - 1) if state else None

    def state_tokens(self, group: int) -> int:
        """A state group's tokens per state block; 0 for an attention group."""
        return self.states[group] if self.states else 0

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
            state = self.state_block(g, num_tokens)
            if state is not None:
                if state >= len(blocks) or blocks[state] == NULL_BLOCK:
                    raise ValueError(f"layers {list(self.layers[g])[:2]} hold no state block after {num_tokens} "
                                     f"tokens (vLLM lists {list(blocks)})")
                out.append(blocks[state])
                continue
            needed = list(blocks[self.first_needed(g, num_tokens):n])
            if NULL_BLOCK in needed:
                raise ValueError(f"blocks of the last {self.windows[g]} tokens of the prompt are freed already "
                                 "(its prefill decoded past them: send prefill requests with max_tokens 1)")
            out += needed
        return out

    def pull(self, block_ids: tuple[list[int], ...] | list[list[int]], num_tokens: int,
             first_block: int) -> tuple[list[int], list[int]]:
        """Consumer: `(blocks, pick)`, its blocks paired with `held`'s list and the positions to pull: those
        from `first_block` on (the ones before are in its prefix cache) that vLLM allocated, and every state.

        Raises:
            ValueError: vLLM allocated no block for a state group's state (the pull cannot be taken).
        """
        n = math.ceil(num_tokens / self.block_size)
        blocks: list[int] = []
        pick: list[int] = []
        for g, ids in enumerate(block_ids):
            state = self.state_block(g, num_tokens)
            if state is not None:
                if state >= len(ids) or ids[state] == NULL_BLOCK:
                    raise ValueError(f"no block to take the state of layers {list(self.layers[g])[:2]} after "
                                     f"{num_tokens} tokens (vLLM allocated {list(ids)})")
                pick.append(len(blocks))
                blocks.append(ids[state])
                continue
            start = self.first_needed(g, num_tokens)
            for b in range(start, n):
                block = ids[b] if b < len(ids) else NULL_BLOCK
                if b >= first_block and block != NULL_BLOCK:
                    pick.append(len(blocks))
                blocks.append(block)
        return blocks, pick

    def planes(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors every group's blocks live in: one per layer position of the largest attention group, by
        the name of that group's layer there. A state group's layer views the same memory another way: its
        blocks must be the plane's pages (same start, same stride), each state within its page.

        Raises:
            ValueError: a group's layer that does not view the same memory as the others at its position.
        """
        attention = [names for g, names in enumerate(self.layers) if not self.state_tokens(g)]
        widest = max(attention, key=len)
        tensors = [kv_caches[name] for name in widest]
        for g, names in enumerate(self.layers):
            if len(names) > len(widest):
                raise ValueError(f"layers {list(names)[:2]}... outnumber the widest attention group's {len(widest)}; "
                                 "kvwire moves KV cache groups that share their tensors (vLLM's hybrid allocator)")
            for i, name in enumerate(names):
                t, plane = kv_caches[name], tensors[i]
                same = (t.data_ptr(), t.shape, t.stride()) == (plane.data_ptr(), plane.shape, plane.stride())
                if not same and not (self.state_tokens(g) and _within_pages(t, plane)):
                    raise ValueError(f"layer {name}'s KV tensor is not the one layer {widest[i]} views; kvwire "
                                     "moves KV cache groups that share their tensors (vLLM's hybrid allocator)")
        return {name: kv_caches[name] for name in widest}


def _kind_of(group: KVCacheGroupSpec) -> tuple[int, int]:
    """`(window, state)` of a KV cache group (the fields of `Groups`), or ValueError naming what is not moved."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return 0, 0
    if type(spec) is SlidingWindowSpec:
        return spec.sliding_window, 0
    if type(spec) is MambaSpec:
        if spec.num_speculative_blocks:
            raise ValueError(f"layers {list(group.layer_names)[:3]} keep {spec.num_speculative_blocks} speculative "
                             "state blocks (speculative decoding); kvwire moves Mamba state without them: serve "
                             "without --speculative-config")
        return 0, spec.block_size
    raise ValueError(f"kvwire moves full and sliding-window attention KV and Mamba state; layers "
                     f"{list(group.layer_names)[:3]} cache {type(spec).__name__} (chunked-local attention and the "
                     "like are not moved): serve this model without a KV connector")


def _within_pages(state: torch.Tensor, plane: torch.Tensor) -> bool:
    """Whether the state view's blocks are the plane's pages: same start, same page stride in bytes (the plane
    may split a page into kernel blocks), each state inside its page."""
    if not state.dim() or not state.shape[0] or plane.shape[0] % state.shape[0]:
        return False
    page = plane.stride(0) * plane.element_size() * (plane.shape[0] // state.shape[0])
    extent = (sum((n - 1) * s for n, s in zip(state.shape[1:], state.stride()[1:])) + 1) * state.element_size()
    return (state.data_ptr() == plane.data_ptr() and state.stride(0) * state.element_size() == page
            and extent <= page)
