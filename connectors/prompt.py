"""A prompt's fingerprint: which tokens a location's KV is of.

The producer publishes it with the location (`KVLocation.prompt`); a consumer that knows the prompt it pulls for
compares it with its own (consumer/fit.py), so KV of another prompt of the same length is refused as a mismatch
(and recomputed, counted), never decoded from. It catches what names alone cannot: a proxy that hands one
request's kv_transfer_params to another, or a batch whose prompts were all told one directory key.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def prompt_fingerprint(token_ids: Sequence[int]) -> str:
    """16 hex digits of BLAKE2b over the token ids (as 64-bit integers). On this repository's 2-core CPU machine:
    72 us for 2,048 tokens, 0.47 ms for 16,384, 4.0 ms for 131,072 (most of it turning the list into an array),
    once on each side of a transfer."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).hexdigest()
