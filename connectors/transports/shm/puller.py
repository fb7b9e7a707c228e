"""The consumer's side of a shared-memory transfer: copy the producer's blocks into the consumer's.

Per producer incarnation the puller keeps one mapping: a connection to the producer's
Unix socket (its transport address) and the producer's KV planes as peer.py opens them
(a memfd pool mapped read-only; device planes opened by IPC handle; vLLM's host planes read
by address from the producer's process). A new epoch of that producer, or any failure, drops
the mapping; the next pull maps again. A mapping keeps the producer's memory alive, so every
pull first drops the mappings of producers that have gone (their socket hung up); a read by
address also fails once the producer's socket hangs up during it.

One pull, every wait of which ends at the pull's deadline:

1. Map the producer's pool and hold board, if not mapped yet.
2. Read with no round trip when the location gives the request's hold word and its hidden
   states are in the KVReady or the board's hidden area (hold_board.py): check the hold word,
   copy, check it again, say `ShmRead` (no answer awaited) and return. A hold word that changed
   discards the read; the pull goes on as below (a claim, refused for a released request).
3. Otherwise claim the request: a `PullRequest` on the Unix socket ("hold these blocks for my read").
4. Meanwhile, copy each run of blocks consecutive on both sides, every plane in one batched
   copy (a head slice: its columns of each row; the only copy of those bytes), straight from
   the READY entry's blocks: the producer's wake-up and
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
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.hidden import INLINE_MAX, desc_nbytes, fill_tensors
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.host import elsewhere
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.transports.shm.channel import close_fds, connect, hung_up, peer_cred, recv_msg, send_msg
from kvwire.connectors.transports.shm.cma import CmaError
from kvwire.connectors.transports.shm.copier import BlockCopier
from kvwire.connectors.transports.shm.cuda_ipc import synchronize
from kvwire.connectors.transports.shm.hold_board import ORDERED_LOADS, BoardView, map_board
from kvwire.connectors.transports.shm.peer import PeerPlanes, open_peer
from kvwire.connectors.transports.shm.segment import unpack_tensors
from kvwire.connectors.wire import (
    KVLocation,
    PullReply,
    PullRequest,
    ShmAccess,
    ShmHello,
    ShmRead,
    ShmReadDone,
    ShmSegment,
)
from kvwire.observability.labels import TransportFallback


class ShmRefused(TransferError):
    """This process cannot read the producer's memory, and never will (`fallback` says why: the kernel refused
    cross-memory attach, or CUDA would not open its device memory here): another transport can still carry its KV
    (auto falls back to UCX)."""

    def __init__(self, request_id: str, peer: str, reason: str, fallback: TransportFallback):
        super().__init__(request_id, peer, reason)
        self.fallback = fallback


@dataclass(eq=False)
class _Mapping:
    epoch: int
    address: bytes
    sock: socket.socket
    planes: PeerPlanes  # the producer's KV planes, mapped, opened or read by address; never written
    board: BoardView | None  # the producer's hold words and hidden area, read-only; None: it has none


class SHMPuller:
    def __init__(self, node_id: str, region: KVRegion, lanes: int = 1):
        """Args:
            node_id: this consumer's node id.
            region: this node's KV planes (kvwire's pool, or vLLM's per-layer tensors).
            lanes: threads copying one pull (copier.py; host pools).
        """
        self._node_id = node_id
        self._region = region
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
        try:
            return self._pull(_shm_offer(loc), dst_blocks, hidden, deadline)
        except BaseException as exc:
            self._forget(loc.producer)
            if isinstance(exc, (TransferError, KeyboardInterrupt)):
                raise
            raise TransferError(loc.request_id, loc.producer, f"shared-memory read failed: {exc}") from exc

    def path_to(self, loc: KVLocation) -> DataPath:
        """How `loc`'s producer's planes are read: "shm" (a mapped memfd), "cuda_ipc" or "cma"; "shm" until
        mapped."""
        mapping = self._maps.get(loc.producer)
        return DataPath.of([str(mapping.planes.access if mapping is not None else ShmAccess.MEMFD)])

    def reads_sub_blocks(self, loc: KVLocation) -> bool:
        """Whether `loc`'s producer (mapped: `refusal` was asked) is read by cross-memory attach, which reads blocks
        of another size (connectors/transports/sub_blocks.py) as it reads whole ones."""
        mapping = self._maps.get(loc.producer)
        return mapping is not None and mapping.planes.access == ShmAccess.CMA

    def refusal(self, loc: KVLocation, timeout_s: float) -> ShmRefused | None:
        """Whether the kernel refuses this puller the memory of `loc`'s producer (mapped now, if not yet, within
        `timeout_s`); None: it does not, or the question could not be settled (the pull will say)."""
        try:
            self._mapping(_shm_offer(loc), time.monotonic() + timeout_s)
        except ShmRefused as exc:
            return exc
        except (TransferError, OSError, ValueError):
            self._forget(loc.producer)
        return None

    def close(self) -> None:
        for producer in list(self._maps):
            self._forget(producer)
        self._copier.close()

    def _pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        self._reap()
        mapping = self._mapping(loc, deadline)
        runs = plan_runs(loc.block_ids, dst_blocks)
        dst = self._destination(loc, mapping)
        self._check_ranges(loc, mapping, dst, runs)
        transfer_id = next(self._transfer_ids)
        direct = self._read_direct(mapping, loc, dst, runs, dst_blocks, hidden, transfer_id)
        if direct is not None:
            return direct
        mapping.sock.settimeout(_remaining(loc, deadline))
        claimed_at = time.monotonic()
        send_msg(mapping.sock, PullRequest(request_id=loc.request_id, transfer_id=transfer_id,
                                           consumer=self._node_id, transport_address=self.transport_address,
                                           dst_block_ids=dst_blocks, first_block=loc.first_block,
                                           src_block_ids=loc.block_ids, heads=loc.heads,
                                           block_size=loc.pull_block_size))
        copied = False
        try:
            self._copy(mapping, loc, dst, runs)
            copied = True
        finally:  # read (or failed): the blocks may go, before the answer is even looked at
            done = time.monotonic()
            with contextlib.suppress(OSError):  # a producer that misses this releases them at hold_s
                send_msg(mapping.sock, ShmReadDone(request_id=loc.request_id, transfer_id=transfer_id,
                                                   ok=copied))
        hidden_bytes = self._confirm(mapping, loc, transfer_id, hidden, done - claimed_at)
        return len(dst_blocks) * dst.block_nbytes + hidden_bytes

    def _copy(self, mapping: _Mapping, loc: KVLocation, dst: KVRegion, runs: list[tuple[int, int, int]],
              hidden: Sequence[torch.Tensor] = ()) -> None:
        """The one copy of `runs` out of the producer's planes, finished (CUDA: synchronized) when it returns;
        a producer whose connection hung up meanwhile (it died: what a cross-memory read got may be torn) fails it.

        Raises:
            TransferError: the copy failed.
        """
        try:
            mapping.planes.copy(dst, loc.layout, loc.heads, runs)
        except (OSError, ValueError) as exc:
            raise TransferError(loc.request_id, loc.producer, f"{mapping.planes.access} read failed: {exc}") from exc
        synchronize([*dst.planes, *hidden], also=mapping.planes.device)
        if mapping.planes.access == ShmAccess.CMA and hung_up(mapping.sock):
            raise TransferError(loc.request_id, loc.producer, "producer gone during the read")

    def _destination(self, loc: KVLocation, mapping: _Mapping) -> KVRegion:
        """Our region narrowed to what `loc` lands in (its head slice), checked against the producer's planes.

        Raises:
            TransferError: planes that do not pair with ours.
        """
        region = self._region
        if loc.heads is not None:
            region = region.heads(loc.heads.dst_head, loc.heads.num_heads, loc.heads.per_block)
        if loc.pull_block_size:
            if mapping.planes.access != ShmAccess.CMA:
                raise TransferError(loc.request_id, loc.producer, "blocks of another size are read from a "
                                    f"producer's memory by cross-memory attach only, not {mapping.planes.access}")
            region = region.sub_blocks(loc.pull_block_size)
        ours = self._region.layout.num_kv_heads * self._region.layout.block_size
        row = self._region.planes[0].shape[1]
        theirs = loc.layout.num_kv_heads * loc.layout.block_size
        want = row * theirs // ours if row * theirs % ours == 0 else -1
        if mapping.planes.num_planes != len(region.planes) or mapping.planes.row_nbytes != want:
            raise TransferError(loc.request_id, loc.producer, f"producer planes ({mapping.planes.num_planes} of "
                                f"{mapping.planes.row_nbytes} bytes a row) do not pair with ours "
                                f"({len(region.planes)} of {row}, {loc.layout.num_kv_heads} heads to our {ours})")
        return region

    def _read_direct(self, mapping: _Mapping, loc: KVLocation, dst: KVRegion, runs: list[tuple[int, int, int]],
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
        if not in_hand:  # before the copy's synchronize, which the check after it needs
            board.read_hidden(hold, hidden)
        self._copy(mapping, loc, dst, runs, hidden)
        if not board.still_held(hold):  # released (maybe reused) during the copy: what we read may be torn
            return None
        note = ShmRead(request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
                       transport_address=self.transport_address, dst_block_ids=dst_blocks, first_block=loc.first_block,
                       src_block_ids=loc.block_ids, heads=loc.heads, block_size=loc.pull_block_size)
        with self._notes_lock:
            self._notes.append((time.monotonic(), mapping.sock, note))
        return len(dst_blocks) * dst.block_nbytes + nbytes

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

    def _check_ranges(self, loc: KVLocation, mapping: _Mapping, region: KVRegion,
                      runs: list[tuple[int, int, int]]) -> None:
        src_blocks, dst_blocks = mapping.planes.num_blocks, region.num_blocks
        if loc.pull_block_size:
            src_blocks *= loc.layout.block_size // loc.pull_block_size
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
                planes = self._map(loc, segment, pool_fds, sock)
            finally:
                close_fds(fds)
        except BaseException:
            sock.close()
            raise
        return _Mapping(loc.producer_epoch, loc.transport_address, sock, planes, board)

    def _map(self, loc: KVLocation, segment: ShmSegment, fds: list[int], sock: socket.socket) -> PeerPlanes:
        if (segment.producer, segment.epoch) != (loc.producer, loc.producer_epoch):
            raise TransferError(loc.request_id, loc.producer, f"socket belongs to {segment.producer} epoch "
                                f"{segment.epoch}, not epoch {loc.producer_epoch}")
        try:
            planes = open_peer(segment, fds, peer_cred(sock)[0], self._copier)
        except CmaError as exc:
            if exc.refused:
                raise ShmRefused(loc.request_id, loc.producer, f"cross-memory attach refused: {exc}",
                                 TransportFallback.CMA_REFUSED) from exc
            raise TransferError(loc.request_id, loc.producer, f"cannot read the producer's planes: {exc}") from exc
        except RuntimeError as exc:  # CUDA would not open a handle here (its device not visible, no peer access)
            raise ShmRefused(loc.request_id, loc.producer, f"CUDA IPC open failed: {exc}",
                             TransportFallback.CUDA_IPC_REFUSED) from exc
        except (OSError, ValueError) as exc:
            raise TransferError(loc.request_id, loc.producer,
                                f"cannot open the producer's {segment.access} planes: {exc}") from exc
        return planes

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
