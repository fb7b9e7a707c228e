"""The consumer's side of a UCX transfer: pull one request's KV into its blocks.

One pull:

1. Ask the producer over the side channel to send.
2. Post a tagged receive for every piece straight into the destination blocks and
   hidden-state tensors (small pieces come packed into staging slots and are copied out:
   packing.py; a device pool's slots are on its device, packed and unpacked there), spread
   over the lanes (lanes.py: one worker and thread each).
3. Poll the lanes and the reply socket until the receives complete, the producer
   refuses, or the deadline passes.

Completed receives are the whole proof: their tags name this transfer, which only the
producer's sends of it carry, and it posts those only for a request it holds, and
releases the blocks only once the sends complete, after our reads. So the producer's ok
is not awaited (it costs a zmq round trip); a later pull skips it as stale.

On any failure the receives still posted are cancelled, and then the lanes are replaced
(`_fence`): a receive UCX has already matched to the producer's rendezvous cannot be
cancelled, and once a cut link comes back the producer's data for it would still land in
memory the node has since freed or given to another request (heap corruption, seen with
a data link taken down mid-transfer). Dropping the workers, with their contexts and memory
registrations, is the one fence UCX offers; the new lanes have a new address, which the
consumer republishes before its next pull.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.control.side_channel import SideChannelClient
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.kv_region import KVRegion, Part, consumer_runs, consumer_stream
from kvwire.connectors.transports.piece_copy import DevicePieces
from kvwire.connectors.transports.transport import ConfirmedPulls
from kvwire.connectors.transports.ucx.lanes import ReceiveLanes
from kvwire.connectors.transports.ucx.packing import DEVICE_PACK_BELOW, PACK_BELOW, piece_sizes
from kvwire.connectors.transports.ucx.worker import MAX_PIECES, error_handling
from kvwire.connectors.wire import KVLocation, PullRequest

log = logging.getLogger(__name__)


class UCXPuller(ConfirmedPulls):
    def __init__(self, node_id: str, region: KVRegion, lanes: int = 1):
        """Args:
        lanes: workers reading each pull, each on its own thread (host pools; a CUDA pool uses one).
        """
        self._node_id = node_id
        self._region = region
        on_host = region.planes[0].device.type == "cpu"
        self._num_lanes = lanes if on_host else 1
        self._slots_on = None if on_host else region.planes[0].device  # where packs land (lanes.py)
        self._lanes = ReceiveLanes(self._num_lanes, self._slots_on)
        self._pack_below = PACK_BELOW if on_host else DEVICE_PACK_BELOW
        self._channel = SideChannelClient()
        self._transfer_ids = itertools.count(1)

    @property
    def transport_address(self) -> bytes:
        return self._lanes.address

    def path_to(self, loc: KVLocation) -> DataPath:
        """The transports UCX selected to `loc`'s producer (pulling thread only, like `pull`)."""
        return self._lanes.path_to(loc.transport_address, self._guarded(loc))

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Receive `loc`'s blocks into `dst_blocks` and its hidden tensors into `hidden`.

        Returns:
            Bytes received.
        Raises:
            TransferError: refused, failed, or not complete by `deadline`.
        """
        start = time.perf_counter()
        parts, land = self._parts(loc, dst_blocks, hidden)
        transfer_id = next(self._transfer_ids)
        try:
            # Endpoints first (made once per producer): lanes that cannot reach the producer fail before it is
            # asked to send to them. Then ask, and post the receives while the producer handles the request: a
            # send that arrives before its receive waits in UCX's unexpected queue (rendezvous: only its header).
            self._lanes.connect(loc.transport_address, self._guarded(loc))
            self._channel.send(loc.side_channel, PullRequest(
                request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
                transport_address=self._lanes.address, dst_block_ids=dst_blocks, first_block=loc.first_block,
                src_block_ids=loc.block_ids, block_size=loc.pull_block_size,
                heads=loc.heads, pack_below=self._pack_below, host=host_identity(), guarded=self._guarded(loc),
                layer_major=True,  # a layer-wise location's blocks land layer by layer, as it sends them
                packed=land is not None))
            layer_pieces = (len(parts) - len(hidden)) // self._region.layout.num_layers if loc.layerwise else 0
            self._lanes.post(loc.transport_address, parts, transfer_id, self._pack_below, layer_pieces,
                             self._guarded(loc))
            # Spin until done: blocking on the side channel could miss a lane finishing on its own
            # thread (nothing would wake us; a producer's ok may have come already).
            self._channel.wait(loc, transfer_id, deadline, progress=self._lanes.progress,
                               can_block=lambda: False, done=self._lanes.done, reply_needed=False)
            self._lanes.check_errors()
            self._lanes.flush()  # the producer's sends complete on our acknowledgements
            if land is not None:
                land()  # packed sub-blocks from the staging buffer into their blocks
            if log.isEnabledFor(logging.DEBUG):
                log.debug("pulled %s from %s: %d pieces in %.2f ms; %s", loc.request_id, loc.producer, len(parts),
                          (time.perf_counter() - start) * 1e3, self._lanes.summary())
        except BaseException as exc:
            self._lanes.stop(loc.transport_address)
            self._fence()
            self._channel.drop(loc.side_channel)
            if isinstance(exc, (TransferError, KeyboardInterrupt)):
                raise
            raise TransferError(loc.request_id, loc.producer, f"receive failed: {exc}") from exc
        return sum(piece_sizes(parts))

    def _parts(self, loc: KVLocation, dst_blocks: list[int],
               hidden: list[torch.Tensor]) -> tuple[Sequence[Part], Callable[[], None] | None]:
        """Where the pull lands: a device pool's pieces known by address (unpacked by one kernel a slot:
        piece_copy.py), a host pool's as buffers (its sub-blocks in one, unpacked by the callable returned once
        the pull is complete: kv_region.consumer_stream; None: nothing to unpack).

        Raises:
            TransferError: more pieces than UCX's tags can name, or blocks outside the pool.
        """
        if self._slots_on is None:
            return consumer_stream(self._region, loc, dst_blocks, hidden, MAX_PIECES)
        region, runs = consumer_runs(self._region, loc, dst_blocks, len(hidden), MAX_PIECES)
        try:
            return DevicePieces(region, region.spans(runs, layer_major=loc.layerwise), hidden), None
        except ValueError as exc:
            raise TransferError(loc.request_id, loc.producer, str(exc)) from exc

    def _guarded(self, loc: KVLocation) -> bool:
        """Endpoint error handling to `loc`'s producer (worker.py's `error_handling`; the producer is told)."""
        return error_handling(loc.host, self._slots_on is not None)

    def _fence(self) -> None:
        """Replace the lanes after a failed pull (see the module docstring): the old workers are never
        progressed again, and go with their contexts once closed."""
        old, self._lanes = self._lanes, ReceiveLanes(self._num_lanes, self._slots_on)
        old.close()

    def close(self) -> None:
        self._channel.close()
        self._lanes.close()
