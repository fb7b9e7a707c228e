"""Names for the full KV blocks of a token sequence, each standing for the whole prefix up to its block's end.

A block's name is a 128-bit BLAKE2b digest chained over its parent's name and its own token ids, as vLLM's
prefix cache names its blocks: two sequences share a block's name exactly when they share every token up to
that block's end (a collision is as likely as one of BLAKE2b's). The decode node's prefix cache
(`BlockAllocator`) keeps computed blocks under these names; the router predicts with them which node holds
what (router/prefix_index.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROOT = b""  # the name of the empty prefix


def next_name(parent: bytes, block: Sequence[int]) -> bytes:
    """The name of the block of tokens `block` that follows the prefix named `parent`."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in block))
    return digest.digest()


def block_names(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Returns: one name per full block of `tokens` (a partial last block has none)."""
    names, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = next_name(parent, tokens[start:start + block_size])
        names.append(parent)
    return names
