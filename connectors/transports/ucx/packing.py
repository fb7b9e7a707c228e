"""Small pieces travel packed: many pieces per UCX message, through reused staging slots.

Every tagged operation costs Python time on each side (the request object, the buffer
wrapper), so vLLM's per-layer pool, whose 2,048-token request is 8,192 pieces of 32 KiB,
spent longer per side just posting them than copying them (docs/BENCHMARKS.md). A consumer
with a host pool therefore asks (`PullRequest.pack_below`) for every piece smaller than
PACK_BELOW to come packed: the producer copies runs of consecutive small pieces into a
staging slot of at most PACK_BYTES and sends the slot as one message; the consumer
receives it into a slot of its own and copies the pieces out to their blocks. Pieces
of PACK_BELOW or more (kvwire's pool: a whole block is 2 MiB for Llama-3-8B) still go
zero-copy, one message each.

Both sides derive the same message list from the pieces' sizes alone (`plan_messages`),
so nothing about the packing travels but the threshold. Packed transfers tag their
messages with PACKED_BIT: a producer that ignores `pack_below` (an older build) sends
per-piece messages that can never match a packed receive (the pull times out and the
consumer recomputes) instead of landing in the wrong place.

Slots come from a `Staging` pool, created on first use and reused across transfers; a
slot whose message failed or was abandoned is discarded, never reused, since a late
read or write of it could still be under way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwire.connectors.transports.block_copy import gather_parts, scatter_parts
from kvwire.connectors.transports.kv_region import Part, part_nbytes

PACK_BYTES = 1 << 20  # one packed message at most (and a staging slot's size)
PACK_BELOW = 256 << 10  # a consumer's threshold: pieces smaller than this travel packed


@dataclass(frozen=True)
class Message:
    first: int  # index of its first piece
    count: int  # pieces it carries, consecutive (1 for an unpacked piece)
    nbytes: int
    packed: bool  # through staging slots (else straight from and into the piece)


def plan_messages(sizes: list[int], pack_below: int, boundary: int = 0) -> list[Message]:
    """The messages a transfer of pieces of `sizes` bytes is sent as, in order.

    Part of the wire: producer and consumer must derive the same list (a message shorter than
    the receive posted for it completes without error), so a change here needs a new WIRE_VERSION.

    Args:
        boundary: no pack spans a multiple of this many pieces (a layer-wise stream's layers, so
            that each layer's last pack goes as soon as the layer is written); 0: none.
    Raises:
        ValueError: `pack_below` outside 0..PACK_BYTES (a peer's bad request).
    """
    if not 0 <= pack_below <= PACK_BYTES:
        raise ValueError(f"pack_below {pack_below} outside 0..{PACK_BYTES}")
    out: list[Message] = []
    start, nbytes = 0, 0  # the pack being filled: its first piece, its bytes so far

    def close_pack(end: int) -> None:
        if end > start:
            out.append(Message(start, end - start, nbytes, True))

    for i, size in enumerate(sizes):
        if boundary and i and i % boundary == 0:
            close_pack(i)
            start, nbytes = i, 0
        if size >= pack_below:
            close_pack(i)
            out.append(Message(i, 1, size, False))
            start, nbytes = i + 1, 0
        elif nbytes + size > PACK_BYTES:
            close_pack(i)
            start, nbytes = i, size
        else:
            nbytes += size
    close_pack(len(sizes))
    return out


class Staging:
    """Up to `max_slots` host buffers of PACK_BYTES, handed out and taken back. One thread uses it."""

    def __init__(self, max_slots: int):
        self._free: list[memoryview] = []
        self._live = 0  # slots in existence (free or taken)
        self._max = max_slots

    def take(self) -> memoryview | None:
        """A free slot, or None when every slot is taken."""
        if self._free:
            return self._free.pop()
        if self._live == self._max:
            return None
        self._live += 1
        return memoryview(bytearray(PACK_BYTES))

    def give(self, slot: memoryview) -> None:
        self._free.append(slot)

    def discard(self, slot: memoryview) -> None:
        """Forget a slot that a failed transfer may still touch (a new one may be made in its place)."""
        self._live -= 1


def gather(parts: list[Part], msg: Message, slot: memoryview) -> memoryview:
    """Copy `msg`'s pieces into `slot`, back to back; the filled part of the slot.

    Host pieces are copied one by one (a memoryview slice assignment is cheaper than any tensor op);
    device pieces in a few launches and one copy to the host (transports/block_copy.py).
    """
    pieces = parts[msg.first:msg.first + msg.count]
    devices = _all_device(pieces)
    if devices is not None:
        gather_parts(devices, torch.frombuffer(slot, dtype=torch.uint8))
        return slot[:sum(t.numel() for t in devices)]
    pos = 0
    for part in pieces:
        n = part_nbytes(part)
        if isinstance(part, memoryview):
            slot[pos:pos + n] = part
        else:  # device memory: copied to the host slot
            torch.frombuffer(slot[pos:pos + n], dtype=torch.uint8).copy_(part)
        pos += n
    return slot[:pos]


def scatter(slot: memoryview, parts: list[Part], msg: Message) -> None:
    """Copy a received pack out of `slot` into `msg`'s pieces (device pieces: as in `gather`)."""
    pieces = parts[msg.first:msg.first + msg.count]
    devices = _all_device(pieces)
    if devices is not None:
        scatter_parts(torch.frombuffer(slot, dtype=torch.uint8), devices)
        return
    pos = 0
    for part in pieces:
        n = part_nbytes(part)
        if isinstance(part, memoryview):
            part[:] = slot[pos:pos + n]
        else:
            part.copy_(torch.frombuffer(slot[pos:pos + n], dtype=torch.uint8))
        pos += n


def _all_device(pieces: list[Part]) -> list[torch.Tensor] | None:
    """The pieces, when more than one and every one in device memory (one device); else None."""
    if len(pieces) < 2 or not all(isinstance(p, torch.Tensor) for p in pieces):
        return None
    tensors = [p for p in pieces if isinstance(p, torch.Tensor)]
    return tensors if len({t.device for t in tensors}) == 1 else None
