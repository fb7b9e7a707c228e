"""One transfer's bytes as a list of parts, moved in order by sendmsg / recvmsg_into.

Host parts (CPU tensors) are handed to the socket as memoryviews of the tensors'
own memory, up to IOV_MAX of them per call: no copy. Device parts (CUDA tensors;
sockets cannot touch GPU memory) pass through one fixed pinned staging buffer, a
chunk at a time: copied out of the device before it is sent, or into the device once
a chunk has been received. A chunk is either a slice of one large part or as many
whole consecutive device parts as fit, gathered (or scattered) in a few launches
(transports/block_copy.py), not one copy per part. Partial calls are the normal case: `advance(n)` moves past
the n bytes the last call moved. Memory used is one int per part for bookkeeping,
the batch list, and, only when a device part is met, STAGING_BYTES: nothing grows
with the bytes moved.
"""

from __future__ import annotations

import bisect
import itertools
import socket
from typing import cast

import torch

from kvwire.connectors.transports.block_copy import gather_parts, scatter_parts
from kvwire.connectors.transports.kv_region import Part, byte_parts, part_nbytes
from kvwire.connectors.transports.tcp.frames import IOV_MAX

STAGING_BYTES = 8 << 20  # per connection with device parts; PCIe outruns TCP, so one buffer suffices

class Staging:
    """A pinned host buffer, allocated on first use and kept for the owner's lifetime."""

    def __init__(self, nbytes: int = STAGING_BYTES):
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = None
        self._view: memoryview | None = None

    def get(self) -> tuple[torch.Tensor, memoryview]:
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self._view = self._buf.numpy().data  # memoryview(numpy()), as numpy types it for Python 3.11
        assert self._view is not None  # set with _buf
        return self._buf, self._view


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
        self._chunk = 0  # device parts: bytes of them in the staging buffer
        self._staged: list[torch.Tensor] = []  # the device parts (or one part's slice) the staging buffer holds
        self._chunk_moved = 0  # of which the socket has moved this many
        self.remaining = self._ends[-1] if parts else 0
        self._seek(0)

    @property
    def done(self) -> bool:
        return self.remaining == 0

    @property
    def moved_any(self) -> bool:
        return self._pos > 0 or self._chunk_moved > 0

    def batch(self, max_buffers: int = IOV_MAX, max_bytes: int | None = None) -> list[memoryview]:
        """Buffers for the next call: a run of host parts, or the staged chunk of a device part.

        Args:
            max_buffers: at most this many buffers (the kernel's IOV_MAX).
            max_bytes: stop after the buffer that reaches this many bytes (None: no limit);
                a non-blocking send gains nothing from offering more than its socket takes.
        """
        start, part = self._index, self._parts[self._index]
        if isinstance(part, torch.Tensor):
            if not self._chunk:
                self._stage(part)
            return [self._staging.get()[1][self._chunk_moved:self._chunk]]
        stop = min(len(self._parts), start + max_buffers, self._next_device(start + 1))
        if max_bytes is not None:
            stop = min(stop, bisect.bisect_left(self._ends, self._pos + max_bytes) + 1)
        hosts = cast(list[memoryview], self._parts[start + 1:stop])  # stop is at or before the next device part
        return [part[self._offset:] if self._offset else part, *hosts]

    def advance(self, nbytes: int) -> None:
        """Account for `nbytes` moved from the start of the last batch."""
        assert 0 <= nbytes <= self.remaining, "moved more bytes than the parts hold"
        self.remaining -= nbytes
        if self._chunk:
            self._advance_staged(nbytes)
        else:
            self._seek(self._pos + nbytes)

    def _seek(self, pos: int) -> None:
        """Move to absolute byte `pos`: the first part ending after it (empty parts skipped)."""
        self._pos = pos
        self._index = bisect.bisect_right(self._ends, pos)
        self._offset = pos - (self._ends[self._index - 1] if self._index else 0)

    def _next_device(self, index: int) -> int:
        i = bisect.bisect_left(self._devices, index)
        return self._devices[i] if i < len(self._devices) else len(self._parts)

    def _stage(self, part: torch.Tensor) -> None:
        buf, _ = self._staging.get()
        if self._offset or part.numel() >= self._staging.nbytes:  # a large part goes a chunk at a time
            self._staged = [part[self._offset:self._offset + min(self._staging.nbytes, part.numel() - self._offset)]]
        else:
            self._staged = self._whole_parts(part)
        self._chunk = sum(p.numel() for p in self._staged)
        self._chunk_moved = 0
        if self._outbound:
            gather_parts(self._staged, buf)

    def _whole_parts(self, first: torch.Tensor) -> list[torch.Tensor]:
        """The device parts from the current one on that fit the staging buffer whole, same device, in order."""
        stop = bisect.bisect_right(self._ends, self._pos + self._staging.nbytes)  # parts ending within reach
        out = [first]
        for part in self._parts[self._index + 1:stop]:
            if not isinstance(part, torch.Tensor) or part.device != first.device:
                break
            out.append(part)
        return out

    def _advance_staged(self, nbytes: int) -> None:
        self._chunk_moved += nbytes
        assert self._chunk_moved <= self._chunk, "moved past the staged chunk"
        if self._chunk_moved < self._chunk:
            return
        if not self._outbound:
            scatter_parts(self._staging.get()[0], self._staged)
        chunk, self._chunk, self._chunk_moved, self._staged = self._chunk, 0, 0, []
        self._seek(self._pos + chunk)


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
