"""Optional end-to-end check of the KV bytes (`--verify-kv`): one crc32 per layer.

The producer computes them over the request's blocks when it publishes; the consumer
recomputes them over its own blocks after the pull, and a mismatch fails the transfer
(the prompt is then recomputed). It costs a read of every byte on each side, at the
speed of zlib's crc32 on one core (CUDA blocks are copied to the host piece by piece),
which is why it is off by default: the transports already check lengths and the
directory fences stale producers.
"""

from __future__ import annotations

import zlib

from kvwire.connectors.transports.kv_region import KVRegion


def layer_checksums(region: KVRegion, blocks: list[int]) -> list[int]:
    """crc32 of each layer's K and V in `blocks`, in block order (`KVRegion.layer_parts`, block by block)."""
    runs = [(b, 1) for b in blocks]
    sums = []
    for layer in range(region.layout.num_layers):
        crc = 0
        for part in region.layer_parts(runs, layer):
            crc = zlib.crc32(part if isinstance(part, memoryview) else part.cpu().numpy().data, crc)
        sums.append(crc)
    return sums
