"""One transfer's bytes as a list of parts, moved in order by sendmsg / recvmsg_into.

Host parts (CPU tensors) are handed to the socket as memoryviews of the tensors'
own memory, up to IOV_MAX of them per call: no copy. Device parts (CUDA tensors;
sockets cannot touch GPU memory) pass through a fixed pinned staging buffer, a chunk
at a time: copied out of the device before it is sent, or into the device once a
chunk has been received. A chunk is either a slice of one large part or as many
whole consecutive device parts as fit, gathered (or scattered) in a few launches
(transports/block_copy.py), not one copy per part. The buffer's two halves take
alternate chunks, so that the device copies overlap the socket: a sender gathers
the next chunk while the socket drains this one, a receiver scatters a chunk while
the socket fills the next (each half's copy is waited for before the half is
written again, and every copy before a receiving stream is done). Partial calls are
the normal case: `advance(n)` moves past the n bytes the last call moved. Memory
used is one int per part for bookkeeping, the batch list, and, only when a device
part is met, STAGING_BYTES: nothing grows with the bytes moved.
"""

from __future__ import annotations

import bisect
import itertools
import socket
from collections import deque
from dataclasses import dataclass
from typing import cast

import torch

from kvwire.connectors.transports.block_copy import gather_parts, scatter_parts
from kvwire.connectors.transports.kv_region import Part, byte_parts, part_nbytes
from kvwire.connectors.transports.tcp.frames import IOV_MAX

STAGING_BYTES = 16 << 20  # per connection with device parts: two chunks of 8 MiB; PCIe outruns TCP


class Staging:
    """A host buffer for device parts (pinned, unless a test says not), allocated on first use and kept for
    the owner's lifetime, taken in two halves of `chunk_bytes`. One stream at a time uses it; a half's device
    copy that a stream left running is recorded here, so that the next user of the half waits for it."""

    def __init__(self, nbytes: int = STAGING_BYTES, pinned: bool = True):
        self.nbytes = nbytes
        self._pinned = pinned
        self._buf: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._copies: dict[int, torch.cuda.Event] = {}  # half -> its device copy, maybe still running

    @property
    def chunk_bytes(self) -> int:
        return self.nbytes // 2

    def get(self) -> tuple[torch.Tensor, memoryview]:
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._pinned)
            self._view = self._buf.numpy().data  # memoryview(numpy()), as numpy types it for Python 3.11
        assert self._view is not None  # set with _buf
        return self._buf, self._view

    def half(self, i: int) -> tuple[torch.Tensor, memoryview]:
        """Half `i` (0 or 1) of the buffer, as a tensor and a memoryview."""
        buf, view = self.get()
        lo, n = i * self.chunk_bytes, self.chunk_bytes
        return buf[lo:lo + n], view[lo:lo + n]

    def pending(self, half: int, copy: torch.cuda.Event | None) -> None:
        """Half `half`'s device copy runs until `copy` (None: it is done)."""
        if copy is not None:
            self._copies[half] = copy

    def wait(self, half: int) -> None:
        """Return once half `half`'s device copy, if any, is complete."""
        copy = self._copies.pop(half, None)
        if copy is not None:
            copy.synchronize()

    def settle(self) -> None:
        """Return once every device copy through this buffer is complete."""
        for half in list(self._copies):
            self.wait(half)


@dataclass
class _Chunk:
    half: int  # of the staging buffer
    parts: list[torch.Tensor]  # the device parts it holds, whole, or a slice of one
    nbytes: int


class ByteStream:
    """A position in a transfer's parts; `outbound` streams are sent, the others received.

    Part boundaries are kept as prefix sums, so handing out a batch and advancing past
    a partial call cost a slice and a bisection, not a walk over the parts.
    """

    def __init__(self, parts: list[Part], outbound: bool, staging: Staging):
        self._parts = parts
        self._outbound = outbound
        self._staging = staging
        self._ends = list(itertools.accumulate(part_nbytes(p) for p in parts))  # byte offset where each part ends
        self._devices = [i for i, p in enumerate(parts) if isinstance(p, torch.Tensor)]
        # Device chunks staged, the one the socket moves first; an outbound stream's next one is being gathered.
        self._chunks: deque[_Chunk] = deque()
        self._chunk_moved = 0  # of the first chunk, the socket has moved this many bytes
        self._next_half = 0
        self.remaining = self._ends[-1] if parts else 0
        self._seek(0)

    @property
    def done(self) -> bool:
        return self.remaining == 0

    @property
    def moved_any(self) -> bool:
        return self._pos > 0 or self._chunk_moved > 0

    def batch(self, max_buffers: int = IOV_MAX, max_bytes: int | None = None,
              limit: int | None = None) -> list[memoryview]:
        """Buffers for the next call: a run of host parts, or the staged chunk of device parts.

        Args:
            max_buffers: at most this many buffers (the kernel's IOV_MAX).
            max_bytes: stop after the buffer that reaches this many bytes (None: no limit);
                a non-blocking send gains nothing from offering more than its socket takes.
            limit: no byte this many bytes or more past the position is read, not even into the
                staging buffer (a layer-wise stream's layers the forward has not written); None: none.
        """
        start, part = self._index, self._parts[self._index]
        if isinstance(part, torch.Tensor):
            return [self._device_batch(limit)]
        cap = max_bytes if limit is None else limit if max_bytes is None else min(max_bytes, limit)
        stop = min(len(self._parts), start + max_buffers, self._next_device(start + 1))
        if cap is not None:
            stop = min(stop, bisect.bisect_left(self._ends, self._pos + cap) + 1)
        hosts = cast(list[memoryview], self._parts[start + 1:stop])  # stop is at or before the next device part
        return [part[self._offset:] if self._offset else part, *hosts]

    def advance(self, nbytes: int) -> None:
        """Account for `nbytes` moved from the start of the last batch."""
        assert 0 <= nbytes <= self.remaining, "moved more bytes than the parts hold"
        self.remaining -= nbytes
        if self._chunks:
            self._advance_chunk(nbytes)
        else:
            self._seek(self._pos + nbytes)
        if self.done and not self._outbound:
            self._staging.settle()  # the last chunk's scatter: the caller reads the parts once done

    def _seek(self, pos: int) -> None:
        """Move to absolute byte `pos`: the first part ending after it (empty parts skipped)."""
        self._pos = pos
        self._index = bisect.bisect_right(self._ends, pos)
        self._offset = pos - (self._ends[self._index - 1] if self._index else 0)

    def _next_device(self, index: int) -> int:
        i = bisect.bisect_left(self._devices, index)
        return self._devices[i] if i < len(self._devices) else len(self._parts)

    def _device_batch(self, limit: int | None) -> memoryview:
        """The first staged chunk's bytes not yet moved (staged now if need be); an outbound stream also starts
        gathering the chunk after it, so that the copy runs while the socket drains this one."""
        if not self._chunks:
            chunk = self._stage(self._pos, limit)
            assert chunk is not None, "no byte of the device part at the position may be read"
            self._chunks.append(chunk)
        first = self._chunks[0]
        if self._outbound:
            if len(self._chunks) == 1 and (after := self._stage(self._pos + first.nbytes, limit)) is not None:
                self._chunks.append(after)
            self._staging.wait(first.half)  # its gather is complete
        return self._staging.half(first.half)[1][self._chunk_moved:first.nbytes]

    def _stage(self, pos: int, limit: int | None) -> _Chunk | None:
        """The device chunk that starts at byte `pos`, in the next half (outbound: being gathered into it); None
        where `pos` is not in a device part or the limit leaves no byte of it."""
        index = bisect.bisect_right(self._ends, pos)
        if index == len(self._parts) or not isinstance(part := self._parts[index], torch.Tensor):
            return None
        room = self._staging.chunk_bytes if limit is None else min(self._staging.chunk_bytes, self._pos + limit - pos)
        if room <= 0:
            return None
        offset = pos - (self._ends[index - 1] if index else 0)
        if offset or part.numel() > room:  # a large part goes a chunk at a time
            parts = [part[offset:offset + min(room, part.numel() - offset)]]
        else:
            parts = self._whole_parts(index, pos + room)
        half, self._next_half = self._next_half, self._next_half ^ 1
        self._staging.wait(half)  # the copy it held last has read it (or written it)
        if self._outbound:
            self._staging.pending(half, _gather_async(parts, self._staging.half(half)[0]))
        return _Chunk(half, parts, sum(p.numel() for p in parts))

    def _whole_parts(self, index: int, end: int) -> list[torch.Tensor]:
        """The device parts from `index` on that end by byte `end`, all on the first one's device, in order."""
        first = cast(torch.Tensor, self._parts[index])
        out = [first]
        for part in self._parts[index + 1:bisect.bisect_right(self._ends, end)]:
            if not isinstance(part, torch.Tensor) or part.device != first.device:
                break
            out.append(part)
        return out

    def _advance_chunk(self, nbytes: int) -> None:
        chunk = self._chunks[0]
        self._chunk_moved += nbytes
        assert self._chunk_moved <= chunk.nbytes, "moved past the staged chunk"
        if self._chunk_moved < chunk.nbytes:
            return
        self._chunks.popleft()
        if not self._outbound:
            src = self._staging.half(chunk.half)[0][:chunk.nbytes]
            self._staging.pending(chunk.half, _scatter_async(src, chunk.parts))
        self._chunk_moved = 0
        self._seek(self._pos + chunk.nbytes)


def _gather_async(parts: list[torch.Tensor], out: torch.Tensor) -> torch.cuda.Event | None:
    """`out[:total]` = `parts` back to back (all on one device); a CUDA device's copy is left running: the event
    that marks its end. Elsewhere the copy is done (None)."""
    device = parts[0].device
    if device.type != "cuda":
        gather_parts(parts, out)
        return None
    src = parts[0] if len(parts) == 1 else torch.cat(parts)  # [total] scratch on the device
    out[:src.numel()].copy_(src, non_blocking=True)
    return _recorded(device)


def _scatter_async(src: torch.Tensor, parts: list[torch.Tensor]) -> torch.cuda.Event | None:
    """`parts` = `src` cut in order (host `src`, parts on one device); a CUDA device's copy left running, as in
    `_gather_async`."""
    device = parts[0].device
    if device.type != "cuda":
        scatter_parts(src, parts)
        return None
    if len(parts) == 1:
        parts[0].copy_(src, non_blocking=True)
    else:
        torch.split_with_sizes_copy(src.to(device, non_blocking=True), [p.numel() for p in parts], out=parts)
    return _recorded(device)


def _recorded(device: torch.device) -> torch.cuda.Event:
    """An event after the work launched so far on `device`'s current stream (where the copies above ran)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def pump(sock: socket.socket, tensors: list[torch.Tensor], outbound: bool) -> None:
    """Blocking: send (`outbound`) or receive every byte of `tensors` through `sock`, scatter/gather.

    Raises:
        ConnectionError: the peer closed the connection before the last byte.
    """
    stream = ByteStream(byte_parts(tensors), outbound, Staging())
    while not stream.done:
        moved = sock.sendmsg(stream.batch()) if outbound else sock.recvmsg_into(stream.batch())[0]
        if moved == 0:
            raise ConnectionError("peer closed the connection mid-stream")
        stream.advance(moved)
