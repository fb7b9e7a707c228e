"""The consumer's side of a UCX transfer: pull one request's KV into my blocks.

Asks the producer over the side channel to send, posts a tagged receive for every
piece straight into the destination blocks and hidden-state tensors, and polls the
UCX worker and the reply socket until the receives complete and the producer
confirms, or the deadline passes. On any failure the receives still
posted are cancelled, so no late write can land in blocks that get reused.
"""

from __future__ import annotations

import itertools

import torch

from connectors.base import TransferError
from connectors.kv_region import KVRegion, consumer_pieces
from connectors.side_channel import SideChannelClient
from connectors.ucx.transport import MAX_PIECES, Role, UCXTransport, all_done, check_errors
from connectors.wire import KVLocation, PullRequest


class UCXPuller:
    def __init__(self, node_id: str, region: KVRegion):
        self._node_id = node_id
        self._region = region
        self._transport = UCXTransport(Role.RECEIVER)
        self._channel = SideChannelClient()
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
        pieces = consumer_pieces(self._region, loc.block_ids, dst_blocks, hidden, loc.request_id, loc.producer,
                                 MAX_PIECES)
        transfer_id = next(self._transfer_ids)
        # Ask first, then post the receives while the producer handles the request: a send that
        # arrives before its receive waits in UCX's unexpected queue (rendezvous: only its header).
        self._channel.send(loc.side_channel, PullRequest(
            request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
            transport_address=self._transport.address, dst_block_ids=dst_blocks))
        reqs = self._transport.post_recvs(pieces, transfer_id)
        try:
            self._channel.wait(loc, transfer_id, deadline,
                               progress=self._transport.progress,
                               can_block=lambda: all_done(reqs),  # spin while receiving
                               done=lambda: all_done(reqs))
            check_errors(reqs)
        except BaseException as exc:
            self._abandon(loc.side_channel, reqs)
            if isinstance(exc, (TransferError, KeyboardInterrupt)):
                raise
            raise TransferError(loc.request_id, loc.producer, f"receive failed: {exc}") from exc
        return sum(p.numel() * p.element_size() for p in pieces)

    def close(self) -> None:
        self._channel.close()
        self._transport.close()

    def _abandon(self, side_channel: str, reqs: list) -> None:
        if not all_done(reqs):
            self._transport.cancel_all()
            self._transport.progress()
            self._channel.drop(side_channel)
