"""The consumer's side of a shared-memory transfer: copy the producer's blocks into the consumer's.

Per producer incarnation the puller keeps one mapping: a connection to the producer's
Unix socket (its transport address) and the producer's pool mapped read-only (host)
or opened by IPC handle (CUDA). A new epoch of that producer, or any failure, drops the
mapping; the next pull maps again. A mapping keeps the producer's memory alive, so
every pull first drops the mappings of producers that have gone (their socket hung up).

One pull, every wait of which ends at the pull's deadline:

1. Map the producer's pool and hold board, if not mapped yet.
2. Read with no round trip when the location gives the request's hold word and its hidden
   states are in the KVReady or the board's hidden area (hold_board.py): check the hold word,
   copy, check it again, say `ShmRead` (no answer awaited) and return. A hold word that changed
   discards the read; the pull goes on as below (a claim, refused for a released request).
3. Otherwise claim the request: a `PullRequest` on the Unix socket ("hold these blocks for my read").
4. Meanwhile, copy each run of blocks consecutive on both sides (copier.py; the only copy
   of those bytes), straight from the READY entry's blocks: the producer's wake-up and
   answer overlap the copy, so a pull costs the copy and at most one round trip.
5. Say `ShmReadDone` as soon as the copy ends (no answer awaited): the producer may
   release the blocks.
6. Take the producer's `PullReply`. Only an ok makes the read count: the pull claimed a
   request the producer still held, whose blocks stayed held (never reused) for `hold_s`
   from the claim or until our `ShmReadDone`; a read that ended later than hold_s after
   the claim was sent is discarded. The hidden states follow the reply as one raw packet
   (up to 64 KiB), or come in a sealed memfd attached to it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import msgspec
import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.hidden import INLINE_MAX, desc_nbytes, fill_tensors
from kvwire.connectors.transports.host import elsewhere
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.transports.shm.channel import close_fds, connect, hung_up, recv_msg, send_msg
from kvwire.connectors.transports.shm.copier import BlockCopier
from kvwire.connectors.transports.shm.cuda_ipc import map_cuda, synchronize
from kvwire.connectors.transports.shm.hold_board import ORDERED_LOADS, BoardView, map_board
from kvwire.connectors.transports.shm.segment import map_host, unpack_tensors
from kvwire.connectors.wire import KVLocation, PullReply, PullRequest, ShmHello, ShmRead, ShmReadDone, ShmSegment


@dataclass(eq=False)
class _Mapping:
    epoch: int
    address: bytes
    sock: socket.socket
    blocks: torch.Tensor  # the producer's pool, [num_blocks, block_nbytes] uint8; never written
    board: BoardView | None  # the producer's hold words and hidden area, read-only; None: it has none


class SHMPuller:
    def __init__(self, node_id: str, region: KVRegion, lanes: int = 1):
        """Args:
            node_id: this consumer's node id.
            region: this node's pool; must be block-major (one plane).
            lanes: threads copying one pull (copier.py; host pools).
        Raises:
            ValueError: the pool is not one block-major plane.
        """
        if len(region.planes) != 1:
            raise ValueError(f"node {node_id}: shared memory needs a block-major KV pool (one plane)")
        self._node_id = node_id
        self._dst = region.planes[0]
        self.transport_address = f"shm:{node_id}:{os.getpid()}:{secrets.token_hex(16)}".encode()
        self._maps: dict[str, _Mapping] = {}
        self._transfer_ids = itertools.count(1)
        self._copier = BlockCopier(lanes)
        self._notes: list[tuple[float, socket.socket, ShmRead]] = []  # reads with no claim, not yet told: (when, ...)
        self._notes_lock = threading.Lock()  # pulls add notes on one thread, a node's step may flush on another

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Copy `loc`'s blocks into `dst_blocks` and its hidden states into `hidden`.

        Returns:
            Bytes received.
        Raises:
            TransferError: refused, not confirmed, or not complete by `deadline`.
        """
        if loc.heads is not None:  # shared memory serves kvwire's own pools, which are never head-sliced
            raise TransferError(loc.request_id, loc.producer, "shared memory does not pull head slices")
        try:
            return self._pull(_shm_offer(loc), dst_blocks, hidden, deadline)
        except BaseException as exc:
            self._forget(loc.producer)
            if isinstance(exc, (TransferError, KeyboardInterrupt)):
                raise
            raise TransferError(loc.request_id, loc.producer, f"shared-memory read failed: {exc}") from exc

    def close(self) -> None:
        for producer in list(self._maps):
            self._forget(producer)
        self._copier.close()

    def _pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        self._reap()
        mapping = self._mapping(loc, deadline)
        runs = plan_runs(loc.block_ids, dst_blocks)
        self._check_ranges(loc, mapping, runs)
        transfer_id = next(self._transfer_ids)
        direct = self._read_direct(mapping, loc, runs, dst_blocks, hidden, transfer_id)
        if direct is not None:
            return direct
        mapping.sock.settimeout(_remaining(loc, deadline))
        claimed_at = time.monotonic()
        send_msg(mapping.sock, PullRequest(request_id=loc.request_id, transfer_id=transfer_id,
                                           consumer=self._node_id, transport_address=self.transport_address,
                                           dst_block_ids=dst_blocks, first_block=loc.first_block))
        copied = False
        try:
            self._copier.copy(self._dst, mapping.blocks, runs)
            synchronize([self._dst, mapping.blocks])
            copied = True
        finally:  # read (or failed): the blocks may go, before the answer is even looked at
            done = time.monotonic()
            with contextlib.suppress(OSError):  # a producer that misses this releases them at hold_s
                send_msg(mapping.sock, ShmReadDone(request_id=loc.request_id, transfer_id=transfer_id,
                                                   ok=copied))
        hidden_bytes = self._confirm(mapping, loc, transfer_id, hidden, done - claimed_at)
        return len(dst_blocks) * self._dst.shape[1] + hidden_bytes

    def _read_direct(self, mapping: _Mapping, loc: KVLocation, runs: list[tuple[int, int, int]],
                     dst_blocks: list[int], hidden: list[torch.Tensor], transfer_id: int) -> int | None:
        """The read with no round trip, where the location allows it; None: not made, or discarded.

        `hidden` holds the location's `inline_hidden` already when it has them (the KVReady's, or what
        `read_ahead` read; made by `KVConsumer._hidden_for`); otherwise they come from the board's hidden
        area, inside the check."""
        hold, board = loc.shm_hold, mapping.board
        if hold is None or board is None or not ORDERED_LOADS:
            return None
        nbytes = sum(t.numel() * t.element_size() for t in hidden)
        in_hand = len(loc.inline_hidden) == nbytes
        if not in_hand and not board.has_hidden(hold, nbytes):
            return None
        if not board.still_held(hold):
            return None
        self._copier.copy(self._dst, mapping.blocks, runs)
        if not in_hand:
            board.read_hidden(hold, hidden)
        synchronize([self._dst, mapping.blocks, *hidden])
        if not board.still_held(hold):  # released (maybe reused) during the copy: what we read may be torn
            return None
        note = ShmRead(request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
                       transport_address=self.transport_address, dst_block_ids=dst_blocks, first_block=loc.first_block)
        with self._notes_lock:
            self._notes.append((time.monotonic(), mapping.sock, note))
        return len(dst_blocks) * self._dst.shape[1] + nbytes

    def read_ahead(self, loc: KVLocation) -> bytes:
        """`loc`'s hidden states from its producer's hidden area, when that producer is mapped already: read as
        the location comes, off the pull's way (cold, the torch calls of a read cost 50-100 µs here). The
        pull's check of the hold word, after its copy, vouches for them as for the blocks; b"": not read."""
        mapping, hold = self._maps.get(loc.producer), loc.shm_hold
        if mapping is None or mapping.board is None or hold is None or mapping.epoch != loc.producer_epoch or \
                not ORDERED_LOADS:
            return b""
        nbytes = sum(desc_nbytes(d) for d in loc.hidden)
        if not nbytes or not mapping.board.has_hidden(hold, nbytes) or not mapping.board.still_held(hold):
            return b""
        return bytes(mapping.board.area[hold.hidden_at:hold.hidden_at + nbytes])

    def flush(self, older_than_s: float = 0.0) -> None:
        """Tell producers which requests were read with no claim (those read at least `older_than_s` ago), once
        the caller is done with them: the producer's wake-up and bookkeeping then do not compete with the
        caller's receive and first token."""
        cutoff = time.monotonic() - older_than_s
        with self._notes_lock:
            notes = [n for n in self._notes if n[0] <= cutoff]
            self._notes = [n for n in self._notes if n[0] > cutoff]
        for _, sock, note in notes:
            with contextlib.suppress(OSError):  # a producer that misses this releases the blocks at its deadline
                send_msg(sock, note)

    def _confirm(self, mapping: _Mapping, loc: KVLocation, transfer_id: int, hidden: list[torch.Tensor],
                 read_s: float) -> int:
        """The producer's answer to our claim: whether the read we just made stands; its hidden states."""
        try:
            reply, fds = recv_msg(mapping.sock, expect=PullReply)
        except TimeoutError:
            raise TransferError(loc.request_id, loc.producer, "read not confirmed before the deadline") from None
        try:
            assert isinstance(reply, PullReply)  # recv_msg accepts nothing else
            if (reply.request_id, reply.transfer_id) != (loc.request_id, transfer_id):
                raise TransferError(loc.request_id, loc.producer, f"confirmation of another pull: {reply}")
            if not reply.ok:
                raise TransferError(loc.request_id, loc.producer, f"producer did not confirm the read: {reply.reason}")
            if read_s >= reply.hold_s:  # the producer may have released the blocks mid-read
                raise TransferError(loc.request_id, loc.producer, f"read outlasted the {reply.hold_s:.1f} s hold")
            if reply.inline_bytes or not fds:
                return self._take_inline(mapping.sock, loc, reply.inline_bytes, hidden)
            return self._take_hidden(loc, fds, hidden)
        finally:
            close_fds(fds)

    @staticmethod
    def _take_inline(sock: socket.socket, loc: KVLocation, nbytes: int, hidden: list[torch.Tensor]) -> int:
        """The hidden states from the raw packet after the reply."""
        want = sum(t.numel() * t.element_size() for t in hidden)
        if nbytes != want or nbytes > INLINE_MAX:
            raise TransferError(loc.request_id, loc.producer, f"{nbytes} bytes of hidden states; expected {want}")
        if nbytes == 0:
            return 0
        data = bytearray(nbytes + 1)  # one more: a longer packet shows as a longer read
        got = sock.recv_into(data)
        if got != nbytes:
            raise TransferError(loc.request_id, loc.producer, f"hidden-state packet of {got} bytes; expected {nbytes}")
        return fill_tensors(hidden, memoryview(data)[:nbytes])

    @staticmethod
    def _take_hidden(loc: KVLocation, fds: list[int], hidden: list[torch.Tensor]) -> int:
        if sum(t.numel() for t in hidden) == 0:
            if fds:
                raise TransferError(loc.request_id, loc.producer, "hidden states sent for a request without any")
            return 0
        if len(fds) != 1:
            raise TransferError(loc.request_id, loc.producer, f"{len(fds)} hidden-state memfds, expected 1")
        return unpack_tensors(fds[0], hidden)

    def _check_ranges(self, loc: KVLocation, mapping: _Mapping, runs: list[tuple[int, int, int]]) -> None:
        src_blocks, dst_blocks = mapping.blocks.shape[0], self._dst.shape[0]
        for src, dst, n in runs:
            if src < 0 or dst < 0 or src + n > src_blocks or dst + n > dst_blocks:
                raise TransferError(loc.request_id, loc.producer,
                                    f"blocks {src}+{n} → {dst}+{n} outside pools of {src_blocks} / {dst_blocks}")

    # --- mappings, one per producer incarnation ----------------------------------------

    def _mapping(self, loc: KVLocation, deadline: float) -> _Mapping:
        mapping = self._maps.get(loc.producer)
        if mapping is not None and (mapping.epoch, mapping.address) == (loc.producer_epoch, loc.transport_address):
            return mapping
        self._forget(loc.producer)
        mapping = self._open(loc, deadline)
        self._maps[loc.producer] = mapping
        return mapping

    def _open(self, loc: KVLocation, deadline: float) -> _Mapping:
        path = loc.transport_address.decode("utf-8", errors="strict")
        if not path.startswith("/") or "\0" in path:
            raise TransferError(loc.request_id, loc.producer, f"not a Unix socket path: {path!r}")
        sock = connect(path, _remaining(loc, deadline))
        try:
            send_msg(sock, ShmHello(consumer=self._node_id, transport_address=self.transport_address))
            sock.settimeout(_remaining(loc, deadline))
            segment, fds = recv_msg(sock, expect=ShmSegment)
            try:
                assert isinstance(segment, ShmSegment)  # recv_msg accepts nothing else
                pool_fds, board = fds, None
                if segment.hold_slots and fds:  # the board's descriptor comes last
                    pool_fds, board = fds[:-1], map_board(segment.hold_slots, segment.hold_hidden_bytes, fds[-1])
                blocks = self._map(loc, segment, pool_fds)
            finally:
                close_fds(fds)
        except BaseException:
            sock.close()
            raise
        return _Mapping(loc.producer_epoch, loc.transport_address, sock, blocks, board)

    def _map(self, loc: KVLocation, segment: ShmSegment, fds: list[int]) -> torch.Tensor:
        def bad(reason: str) -> TransferError:
            return TransferError(loc.request_id, loc.producer, reason)

        if (segment.producer, segment.epoch) != (loc.producer, loc.producer_epoch):
            raise bad(f"socket belongs to {segment.producer} epoch {segment.epoch}, not epoch {loc.producer_epoch}")
        if segment.block_nbytes != self._dst.shape[1]:
            raise bad(f"producer blocks hold {segment.block_nbytes} bytes, ours {self._dst.shape[1]}")
        if segment.cuda is not None:
            return map_cuda(segment)
        if len(fds) != 1:
            raise bad(f"{len(fds)} descriptors with the pool, expected 1")
        return map_host(segment, fds[0])

    def _reap(self) -> None:
        """Drop the mappings of producers whose socket hung up (they exited or crashed)."""
        for producer, mapping in list(self._maps.items()):
            if hung_up(mapping.sock):
                self._forget(producer)

    def _forget(self, producer: str) -> None:
        mapping = self._maps.pop(producer, None)
        if mapping is not None:
            mapping.sock.close()  # the pool is unmapped once `mapping.blocks` is collected


def _shm_offer(loc: KVLocation) -> KVLocation:
    """`loc` with the side channel and address of its shared-memory offer, checked to be on our host.

    Raises:
        TransferError: the producer runs on another host, or offers no shared memory.
    """
    if elsewhere(loc.host):
        raise TransferError(loc.request_id, loc.producer,
                            f"producer is on host {loc.host}: shared memory needs one host")
    offer = next((o for o in loc.offers if o.kind == ConnectorKind.SHM), None)
    if offer is not None:
        return msgspec.structs.replace(loc, side_channel=offer.side_channel, transport_address=offer.transport_address)
    if loc.offers or loc.kind != ConnectorKind.SHM:
        raise TransferError(loc.request_id, loc.producer, "the producer offers no shared-memory transfer")
    return loc


def _remaining(loc: KVLocation, deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(loc.request_id, loc.producer, "transfer did not complete before the deadline")
    return remaining
