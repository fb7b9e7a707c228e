"""The consumer's side of a UCX transfer: pull one request's KV into my blocks.

Posts a tagged receive for every piece straight into the destination blocks and
hidden-state tensors, asks the producer (zmq side channel) to send, and waits on
both the UCX worker's event fd and the reply socket until the receives complete and
the producer confirms, or the deadline passes. On any failure the receives still
posted are cancelled, so no late write can land in blocks that get reused.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
import zmq

from connectors.base import TransferError
from connectors.kv_region import KVRegion, plan_runs
from connectors.ucx.transport import MAX_PIECES, UCXTransport, all_done, check_errors
from connectors.wire import KVLocation, PullReply, PullRequest, WireError, decode, encode

log = logging.getLogger(__name__)


class UCXPuller:
    def __init__(self, node_id: str, region: KVRegion):
        self._node_id = node_id
        self._region = region
        self._transport = UCXTransport()
        self._ctx = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._transfer_ids = itertools.count(1)

    @property
    def transport_address(self) -> bytes:
        return self._transport.address

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Receive `loc`'s blocks into `dst_blocks` and its hidden tensors into `hidden`.

        Returns:
            Bytes received.
        Raises:
            TransferError: refused, failed, or not complete by `deadline`.
        """
        runs = plan_runs(loc.block_ids, dst_blocks)
        pieces = self._region.pieces([(d, n) for _, d, n in runs]) + hidden
        if len(pieces) > MAX_PIECES:
            raise TransferError(loc.request_id, loc.producer, f"{len(pieces)} pieces exceed {MAX_PIECES}")
        transfer_id = next(self._transfer_ids)
        reqs = self._transport.post_recvs(pieces, transfer_id)
        try:
            sock = self._socket(loc.side_channel)
            sock.send(encode(PullRequest(
                request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
                transport_address=self._transport.address, dst_block_ids=dst_blocks)))
            self._wait(loc, sock, reqs, transfer_id, deadline)
        except BaseException:
            self._abandon(loc.side_channel, reqs)
            raise
        return sum(p.numel() * p.element_size() for p in pieces)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
        self._transport.close()

    def _wait(self, loc: KVLocation, sock: zmq.Socket, reqs: list, transfer_id: int, deadline: float) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._transport.event_fd, zmq.POLLIN)
        confirmed = False
        while True:
            self._transport.progress()
            while sock.poll(0):
                confirmed |= self._read_reply(loc, sock, transfer_id)
            if confirmed and all_done(reqs):
                try:
                    check_errors(reqs)
                except Exception as exc:  # noqa: BLE001 - UCX raises its own error types
                    raise TransferError(loc.request_id, loc.producer, f"receive failed: {exc}") from exc
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(loc.request_id, loc.producer, "transfer did not complete before the deadline")
            if self._transport.arm():
                poller.poll(int(remaining * 1000) + 1)

    def _read_reply(self, loc: KVLocation, sock: zmq.Socket, transfer_id: int) -> bool:
        try:
            reply = decode(sock.recv(copy=False).buffer, expect=PullReply)
        except WireError as exc:
            log.warning("request %s: bad reply from producer %s: %s", loc.request_id, loc.producer, exc)
            return False
        if reply.transfer_id != transfer_id:
            return False  # a late reply to an abandoned transfer
        if not reply.ok:
            raise TransferError(loc.request_id, loc.producer, f"producer refused: {reply.reason}")
        return True

    def _abandon(self, side_channel: str, reqs: list) -> None:
        if not all_done(reqs):
            self._transport.cancel_all()
            self._transport.progress()
            # A socket with an unanswered request may receive a stale reply; start afresh.
            sock = self._sockets.pop(side_channel, None)
            if sock is not None:
                sock.close(0)

    def _socket(self, side_channel: str) -> zmq.Socket:
        sock = self._sockets.get(side_channel)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
            sock.connect(side_channel)
            self._sockets[side_channel] = sock
        return sock
