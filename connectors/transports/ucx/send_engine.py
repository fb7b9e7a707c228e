"""The producer's UCX send engine: each pull a `SendFlow` (flows.py), advanced on the server thread.

Unpacked pieces go zero-copy, one tagged send each; small pieces, if the consumer asked,
packed through staging slots shared by every pull this engine serves (packing.SendStaging:
host slots, or device slots for a device pool's pieces packed for a device pool; at most
half of them each, so that a consumer that stops reading stalls only itself). A
layer-wise request's messages go as its prefill writes their layers: while every pull
waits for a layer and has nothing in flight the server thread sleeps (the gate wakes it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvwire.connectors.transports.host import elsewhere
from kvwire.connectors.transports.kv_region import KVRegion, Part, packs
from kvwire.connectors.transports.piece_copy import DevicePieces
from kvwire.connectors.transports.transport import SendEngine, SendJob
from kvwire.connectors.transports.ucx.flows import SendFlow
from kvwire.connectors.transports.ucx.packing import SendStaging
from kvwire.connectors.transports.ucx.worker import MAX_PIECES, Role, UCXWorker
from kvwire.connectors.wire import PullRequest

log = logging.getLogger(__name__)


class UCXSendEngine(SendEngine):
    streams_layers = True

    def __init__(self, region: KVRegion | None = None) -> None:
        """`region`: the producer's KV (in CUDA memory or not: worker.py); None, host memory."""
        self._transport = UCXWorker(Role.PRODUCER, region is not None and region.planes[0].device.type == "cuda")
        self._staging = SendStaging()
        self.transport_address = self._transport.address
        self._active: list[SendJob] = []
        # Failed or abandoned pulls' flows, kept (and the buffers their sends read with them) until every message
        # they posted has completed: a send on another lane's endpoint may still read a pull that failed on one.
        self._settling: list[SendFlow] = []

    def fds(self) -> list[int]:
        return []

    @property
    def settling(self) -> int:
        """Failed or abandoned pulls whose sends UCX may still be reading."""
        return len(self._settling)

    def progress(self) -> bool:
        moved = self._transport.progress()
        if self._settling:
            self._settling = [flow for flow in self._settling if not flow.settled()]
        for job in list(self._active):
            flow = _flow(job)
            try:
                moved |= flow.advance()
                if not flow.done():
                    continue
                flow.check_errors()
            except Exception as exc:  # noqa: BLE001 - UCX raises its own error types
                self._drop(job)
                self._transport.forget_failed(job.msg.transport_address)  # closed now, not at the next pull
                self.claims.finish(job, exc)
                continue
            self._active.remove(job)
            log.debug("sent %s to %s: %s", job.msg.request_id, job.msg.consumer, flow.summary())
            self.claims.finish(job, None)
            moved = True
        return moved

    def can_block(self) -> bool:
        # While sends are in flight the server thread spins on progress: every rendezvous step needs
        # both workers progressed, and an epoll wake-up per step cost much of the throughput
        # (docs/BENCHMARKS.md). It naps once nothing moves (connectors/spin.py).
        return all(_flow(job).waiting_on_gate for job in self._active)

    def start(self, job: SendJob) -> None:
        if job.num_pieces > MAX_PIECES:
            raise ValueError(f"{job.num_pieces} pieces exceed {MAX_PIECES}")
        self._transport.forget_all_failed()  # before this pull's endpoints are made or reused
        gate, parts = job.held.gate, _parts(job)
        job.state = SendFlow(self._transport, job.msg.transport_address, parts, job.msg.transfer_id,
                             job.msg.pack_below, self._staging.for_pull(parts, job.msg.pack_below), gate,
                             job.layer_pieces if gate else 0, _guarded(job.msg))
        self._active.append(job)

    def abandon(self, job: SendJob) -> None:
        if job in self._active:
            self._drop(job)
        self._transport.forget_peer(job.msg.transport_address)

    def _drop(self, job: SendJob) -> None:
        self._active.remove(job)
        flow = _flow(job)
        flow.discard_slots()
        if not flow.settled():
            self._settling.append(flow)

    def close(self) -> None:
        self._transport.close()


def _flow(job: SendJob) -> SendFlow:
    flow = job.state
    assert isinstance(flow, SendFlow)  # set by start()
    return flow


def _parts(job: SendJob) -> Sequence[Part]:
    """What the pull sends: a device pool's pieces known by address (packed by one kernel a slot: piece_copy.py),
    a host pool's as buffers."""
    if job.region.planes[0].device.type != "cuda":
        if job.msg.packed and not packs(job.region):
            raise ValueError("packed sub-blocks asked of blocks that do not pack")
        return job.stream_parts() if job.msg.packed else job.parts()
    return DevicePieces(job.region, job.region.spans(job.runs, layer_major=job.held.gate is not None), job.held.hidden)


def _guarded(msg: PullRequest) -> bool:
    """Endpoint error handling as the consumer chose it (worker.py); one that did not say wants it between
    hosts only."""
    return msg.guarded if msg.guarded is not None else elsewhere(msg.host)
