"""Names for the full KV blocks of a token sequence, each standing for the whole prefix up to its block's end.

A block's name is a 128-bit BLAKE2b digest chained over its parent's name and its own token ids, as vLLM's
prefix cache names its blocks: two sequences share a block's name exactly when they share every token up to
that block's end (a collision is as likely as one of BLAKE2b's). The decode node's prefix cache
(`BlockAllocator`) keeps computed blocks under these names; the router predicts with them which node holds
what (router/prefix_index.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = b""  # the name of the empty prefix


def cacheable(prompt_len: int, block_size: int) -> int:
    """The most of a prompt of `prompt_len` tokens that a prefix cache gives: whole blocks, short of its last token
    (computed for its logits), as kvwire's engine and vLLM's scheduler read it."""
    return max(0, prompt_len - 1) // block_size * block_size


def _packed(tokens: Sequence[int]) -> bytes:
    """The tokens as little-endian signed 64-bit integers (the bytes a name is hashed over)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _chained(parent: bytes, packed_block: bytes) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(packed_block)
    return digest.digest()


def next_name(parent: bytes, block: Sequence[int]) -> bytes:
    """The name of the block of tokens `block` that follows the prefix named `parent`."""
    return _chained(parent, _packed(block))


def block_names(tokens: Sequence[int], block_size: int, root: bytes = ROOT) -> list[bytes]:
    """Returns: one name per full block of `tokens` (a partial last block has none), the first chained over `root`
    (a prefix cache of their own: the router's cache scopes, router/vllm/cache_scope.py). The tokens are packed
    once, not per block: this runs on the decode node's loop and on the router's for every prompt."""
    full = len(tokens) // block_size * block_size
    packed, step = _packed(tokens[:full]), block_size * 8
    names, parent = [], root
    for start in range(0, full * 8, step):
        parent = _chained(parent, packed[start:start + step])
        names.append(parent)
    return names
