"""Small pieces travel packed: many pieces per UCX message, through reused staging slots.

Every tagged operation costs Python time on each side (the request object, the buffer
wrapper), so vLLM's per-layer pool, whose 2,048-token request is 8,192 pieces of 32 KiB,
spent longer per side just posting them than copying them (docs/BENCHMARKS.md). A consumer
therefore asks (`PullRequest.pack_below`) for every piece smaller than a threshold to come
packed: the producer copies runs of consecutive small pieces into a staging slot and sends
the slot as one message; the consumer receives it into a slot of its own and copies the
pieces out to their blocks. Larger pieces still go zero-copy, one message each.

Two sizes of pack, told apart by the threshold alone (`pack_bytes`):

- a host pool asks PACK_BELOW: packs of at most PACK_BYTES (1 MiB), in host slots. Pieces of
  256 KiB or more (kvwire's pool: a block is 2 MiB for Llama-3-8B) go alone.
- a device pool asks DEVICE_PACK_BELOW: packs of at most DEVICE_PACK_BYTES (8 MiB), in slots on
  the pool's device where the pieces are in device memory: one batched kernel gathers a slot
  (`torch.cat`), UCX moves it device to device (cuda_ipc on one host, RDMA across hosts) and one
  kernel scatters it (`torch.split_with_sizes_copy`). Why 8 MiB: a message costs tens of
  microseconds of Python and a rendezvous round trip whatever its size; at the tens of GB/s that
  UCX moves between GPUs (docs/BENCHMARKS.md) 8 MiB takes a few hundred microseconds, so that cost
  stays near a tenth, and a 2,048-token vLLM request is a few dozen messages, not thousands. Larger
  slots would gain little more and cost device memory beside vLLM's KV cache: DEVICE_SEND_SLOTS x
  8 MiB on a producer's GPU, LANE_SLOTS x 8 MiB on a consumer's. Pieces of 1 MiB or more go alone:
  they are already messages of that scale.

Both sides derive the same message list from the pieces' sizes and the threshold
(`plan_messages`), so nothing about the packing travels but the threshold. Packed transfers
tag their messages with PACKED_BIT, device-sized ones with DEVICE_PACK_BIT too (worker.py): a
producer that ignores `pack_below`, or that packs at the other size (an older build), sends
messages that can never match the consumer's receives (the pull times out and the consumer
recomputes) instead of landing in the wrong place.

CUDA ordering: a device slot's gather is complete (its stream synchronized) before UCX reads the
slot, and a received slot's scatter is complete before the slot takes the next message (and so
before the pull returns). Slots come from a `Staging` pool, created on first use and reused
across transfers; a slot whose message failed or was abandoned is discarded, never reused, since
a late read or write of it could still be under way (its memory stays allocated a while: see
`Staging.discard`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvwire.connectors.transports.block_copy import gather_parts, scatter_parts
from kvwire.connectors.transports.kv_region import Part, part_nbytes
from kvwire.connectors.transports.piece_copy import DevicePieces

PACK_BYTES = 1 << 20  # a host pool's packs: one message at most (and a host slot's size)
PACK_BELOW = 256 << 10  # a host pool's threshold: pieces smaller than this travel packed
DEVICE_PACK_BYTES = 8 << 20  # a device pool's packs (see the module docstring for the size)
DEVICE_PACK_BELOW = PACK_BYTES  # a device pool's threshold; any above PACK_BELOW asks for device-sized packs

SlotMaker = Callable[[int], Part]  # a new slot of that many bytes


@dataclass(frozen=True)
class Message:
    first: int  # index of its first piece
    count: int  # pieces it carries, consecutive (1 for an unpacked piece)
    nbytes: int
    packed: bool  # through staging slots (else straight from and into the piece)


def pack_bytes(pack_below: int) -> int:
    """The most bytes one pack holds for a consumer's threshold: PACK_BYTES for a host pool's (up to PACK_BELOW),
    DEVICE_PACK_BYTES above. Part of the wire, like `plan_messages`."""
    return DEVICE_PACK_BYTES if pack_below > PACK_BELOW else PACK_BYTES


def plan_messages(sizes: list[int], pack_below: int, boundary: int = 0) -> list[Message]:
    """The messages a transfer of pieces of `sizes` bytes is sent as, in order.

    Part of the wire: producer and consumer must derive the same list (a message shorter than
    the receive posted for it completes without error), so a change here needs a new WIRE_VERSION.

    Args:
        pack_below: pieces smaller than this are packed, at most `pack_bytes(pack_below)` bytes a pack.
        boundary: no pack spans a multiple of this many pieces (a layer-wise stream's layers, so
            that each layer's last pack goes as soon as the layer is written); 0: none.
    Raises:
        ValueError: `pack_below` outside 0..PACK_BYTES (a peer's bad request).
    """
    if not 0 <= pack_below <= PACK_BYTES:
        raise ValueError(f"pack_below {pack_below} outside 0..{PACK_BYTES}")
    limit = pack_bytes(pack_below)
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
        elif nbytes + size > limit:
            close_pack(i)
            start, nbytes = i, size
        else:
            nbytes += size
    close_pack(len(sizes))
    return out


def host_slot(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


def tensor_slots(device: torch.device) -> SlotMaker:
    """Slots as flat uint8 tensors on `device` (a GPU's; the CPU's stands in for one in tests)."""
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device)


class Staging:
    """Up to `max_slots` buffers of `slot_bytes`, handed out and taken back. One thread uses it.

    Args:
        make_slot: makes a slot: host memory (`host_slot`) or a device's (`tensor_slots`).
    """

    def __init__(self, max_slots: int, slot_bytes: int = PACK_BYTES, make_slot: SlotMaker = host_slot):
        self.max_slots, self.slot_bytes = max_slots, slot_bytes
        self._make = make_slot
        self._free: list[Part] = []
        self._live = 0  # slots in existence (free or taken)
        # The last max_slots discarded slots, kept allocated: a device slot given back to torch's caching
        # allocator would be handed to the next tensor at once, and a late UCX write would land in that.
        self._discarded: deque[Part] = deque(maxlen=max_slots)

    def take(self) -> Part | None:
        """A free slot, or None when every slot is taken."""
        if self._free:
            return self._free.pop()
        if self._live == self.max_slots:
            return None
        self._live += 1
        return self._make(self.slot_bytes)

    def give(self, slot: Part) -> None:
        self._free.append(slot)

    def discard(self, slot: Part) -> None:
        """Forget a slot that a failed transfer may still touch (a new one may be made in its place). Its memory
        stays allocated, touched by nothing else, until `max_slots` more slots have been discarded."""
        self._live -= 1
        self._discarded.append(slot)


def wire_buffer(part: Part) -> object:
    """What UCX's buffer wrapper takes for `part`: a host buffer or a CUDA tensor (CPU tensors as numpy arrays)."""
    if isinstance(part, torch.Tensor) and part.device.type == "cpu":
        return part.numpy()
    return part


def piece_sizes(parts: Sequence[Part]) -> list[int]:
    """Every piece's bytes (a `DevicePieces` knows them without making its views)."""
    return parts.sizes if isinstance(parts, DevicePieces) else [part_nbytes(p) for p in parts]


def gather(parts: Sequence[Part], msg: Message, slot: Part) -> Part:
    """Copy `msg`'s pieces into `slot`, back to back; the filled part of the slot.

    A device pool's pieces known by address (`DevicePieces`) into a slot on their device: one kernel
    (piece_copy.py), complete before this returns. A host slot: host pieces are copied one by one (a
    memoryview slice assignment is cheaper than any tensor op); device pieces in a few launches and one
    copy to the host (transports/block_copy.py). A tensor slot otherwise: one `torch.cat` where every piece
    is on the slot's device, complete before this returns.
    """
    if isinstance(parts, DevicePieces) and isinstance(slot, torch.Tensor) and parts.gather(msg.first, msg.count, slot):
        _settle(slot)
        return slot[:msg.nbytes]
    pieces = list(parts[msg.first:msg.first + msg.count])
    if isinstance(slot, torch.Tensor):
        return _gather_tensor(pieces, slot)
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


def scatter(slot: Part, parts: Sequence[Part], msg: Message) -> None:
    """Copy a received pack out of `slot` into `msg`'s pieces (as in `gather`; a tensor slot: one kernel or one
    `torch.split_with_sizes_copy`, complete before this returns, so the slot may take the next message)."""
    if isinstance(parts, DevicePieces) and isinstance(slot, torch.Tensor) and parts.scatter(slot, msg.first, msg.count):
        _settle(slot)
        return
    pieces = list(parts[msg.first:msg.first + msg.count])
    if isinstance(slot, torch.Tensor):
        _scatter_tensor(slot, pieces)
        return
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


def _gather_tensor(pieces: list[Part], slot: torch.Tensor) -> torch.Tensor:
    tensors = [_as_tensor(p) for p in pieces]
    total = sum(t.numel() for t in tensors)
    out = slot[:total]
    if {t.device for t in tensors} == {slot.device}:
        torch.cat(tensors, out=out)  # on a GPU one kernel per up to 128 pieces (block_copy.py)
    else:  # hidden states elsewhere than the blocks: a copy each
        pos = 0
        for t in tensors:
            out[pos:pos + t.numel()].copy_(t)
            pos += t.numel()
    _settle(slot)
    return out


def _scatter_tensor(slot: torch.Tensor, pieces: list[Part]) -> None:
    tensors = [_as_tensor(p) for p in pieces]
    sizes = [t.numel() for t in tensors]
    src = slot[:sum(sizes)]
    if {t.device for t in tensors} == {slot.device}:
        torch.split_with_sizes_copy(src, sizes, out=tensors)
    else:
        pos = 0
        for t, n in zip(tensors, sizes):
            t.copy_(src[pos:pos + n])
            pos += n
    _settle(slot)


def _as_tensor(part: Part) -> torch.Tensor:
    """A flat uint8 tensor over `part`'s own memory."""
    if isinstance(part, torch.Tensor):
        return part
    return torch.frombuffer(part, dtype=torch.uint8) if part.nbytes else torch.empty(0, dtype=torch.uint8)


def _settle(slot: torch.Tensor) -> None:
    """Wait for the copies just launched on `slot`'s device: UCX reads and writes device memory on its own
    streams, unordered with ours. This stream only, not the device: the forward may be running beside us."""
    if slot.device.type == "cuda":
        torch.cuda.current_stream(slot.device).synchronize()


def _all_device(pieces: list[Part]) -> list[torch.Tensor] | None:
    """The pieces, when more than one and every one in device memory (one device); else None."""
    if len(pieces) < 2 or not all(isinstance(p, torch.Tensor) for p in pieces):
        return None
    tensors = [p for p in pieces if isinstance(p, torch.Tensor)]
    return tensors if len({t.device for t in tensors}) == 1 else None


SEND_SLOTS = 16  # a producer's host-sized slots (PACK_BYTES), all pulls together
DEVICE_SEND_SLOTS = 8  # a producer's device-sized slots (DEVICE_PACK_BYTES) per place, all pulls together


class SendStaging:
    """A producer's staging, shared by every pull it serves: one `Staging` per place and pack size, made on first
    use (a host pool's producer never allocates device memory, nor a device pool's that serves only host pools).

    A pull's device-sized packs are staged on its pieces' device when they are in device memory, so that UCX sends
    device memory to device memory; every other pack in host memory (a device piece for a host pool's consumer:
    gathered on the device, one copy off it per pack, as before device packing).
    """

    def __init__(self) -> None:
        self._pools: dict[tuple[torch.device | None, int], Staging] = {}

    def for_pull(self, parts: Sequence[Part], pack_below: int) -> Staging:
        """The staging that a pull of `parts`, packed for a consumer's `pack_below`, takes its slots from."""
        size = pack_bytes(pack_below)
        first = parts[0] if parts else None
        device = first.device if size == DEVICE_PACK_BYTES and isinstance(first, torch.Tensor) else None
        if isinstance(parts, DevicePieces) and size == DEVICE_PACK_BYTES:
            device = parts.device
        staging = self._pools.get((device, size))
        if staging is None:
            slots = SEND_SLOTS if size == PACK_BYTES else DEVICE_SEND_SLOTS
            staging = Staging(slots, size, host_slot if device is None else tensor_slots(device))
            self._pools[(device, size)] = staging
        return staging
