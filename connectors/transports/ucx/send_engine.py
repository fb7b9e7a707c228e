"""The producer's UCX send engine: each pull a `SendFlow` (flows.py), advanced on the server thread.

Unpacked pieces go zero-copy, one tagged send each; small pieces, if the consumer asked,
packed through staging slots shared by every pull this engine serves (packing.SendStaging:
host slots, or device slots for a device pool's pieces packed for a device pool; at most
half of them each, so that a consumer that stops reading stalls only itself). A
layer-wise request's messages go as its prefill writes their layers: while every pull
waits for a layer and has nothing in flight the server thread sleeps (the gate wakes it).

A pull that fails or is abandoned with sends in flight *settles*: its flow (with the buffers its sends read)
stays, and so do its blocks (`Claims.finish(..., settling=True)`, `abandon` returning True), until every message
it posted has ended, or DRAIN_S has passed. An abandoned one's endpoints are parked (worker.py `park`), not
force-closed: they close once they fail (the consumer fenced its lanes, or died), carry nothing in flight, or
DRAIN_S is up. A consumer takes completed receives as the whole proof (puller.py), so a send that completes
after the deadline must still read the request's own bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvwire.connectors.transports.host import elsewhere
from kvwire.connectors.transports.kv_region import KVRegion, Part, packs
from kvwire.connectors.transports.piece_copy import DevicePieces
from kvwire.connectors.transports.transport import SendEngine, SendJob
from kvwire.connectors.transports.ucx.flows import SendFlow
from kvwire.connectors.transports.ucx.packing import SendStaging
from kvwire.connectors.transports.ucx.worker import MAX_PIECES, Role, UCXWorker
from kvwire.connectors.wire import PullRequest

log = logging.getLogger(__name__)

# How long a failed or abandoned pull may keep its blocks while its sends are in flight, and its parked
# endpoints stay open: as long as the directory holds an unpulled request's KV (ConnectorConfig.entry_ttl_s's
# default). A link cut for longer is force-closed with its sends stuck, as before parking (README Known limits).
DRAIN_S = 60.0
SETTLE_S = 2.0  # past DRAIN_S: for the forced close to complete its requests (libucp.CLOSE_TIMEOUT_S)


@dataclass
class _Settling:
    """A failed or abandoned pull whose sends may still read its pieces."""

    job: SendJob
    flow: SendFlow
    until: float  # time.monotonic() by which its link is closed, and its blocks go SETTLE_S later at the latest


class UCXSendEngine(SendEngine):
    streams_layers = True

    def __init__(self, region: KVRegion | None = None, drain_s: float = DRAIN_S) -> None:
        """`region`: the producer's KV (in CUDA memory or not: worker.py); None, host memory. `drain_s`: DRAIN_S."""
        self._transport = UCXWorker(Role.PRODUCER, region is not None and region.planes[0].device.type == "cuda")
        self._staging = SendStaging()
        self.transport_address = self._transport.address
        self._active: list[SendJob] = []
        self._drain_s = drain_s
        # Failed or abandoned pulls, kept (their flows' buffers, their blocks) until every message they posted has
        # completed: a send on another lane's endpoint may still read a pull that failed on one (module docstring).
        self._settling: list[_Settling] = []

    def fds(self) -> list[int]:
        return []

    @property
    def settling(self) -> int:
        """Failed or abandoned pulls whose sends UCX may still be reading."""
        return len(self._settling)

    def progress(self) -> bool:
        moved = self._transport.progress()
        if self._settling:
            moved |= self._settle(time.monotonic())
        for job in list(self._active):
            flow = _flow(job)
            try:
                moved |= flow.advance()
                if not flow.done():
                    continue
                flow.check_errors()
            except Exception as exc:  # noqa: BLE001 - UCX raises its own error types
                settling = self._drop(job)
                self._transport.forget_failed(job.msg.transport_address)  # closed now, not at the next pull
                self.claims.finish(job, exc, settling)
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

    def abandon(self, job: SendJob) -> bool:
        if job in self._active:
            self._drop(job)
        settling = next((s for s in self._settling if s.job is job), None)
        if settling is None:
            self._transport.forget_peer(job.msg.transport_address)
            return False
        if self._transport.park(job.msg.transport_address, settling.until):
            log.info("request %s: pull by %s abandoned with %d sends in flight over TCP; its endpoints stay open and "
                     "its blocks held until they fail or drain (at most %.0f s)", job.msg.request_id,
                     job.msg.consumer, settling.flow.in_flight(), self._drain_s)
        return True

    def _drop(self, job: SendJob) -> bool:
        """Take a failed or abandoned job out of those in flight; returns whether it settles (module docstring)."""
        self._active.remove(job)
        flow = _flow(job)
        flow.discard_slots()
        if flow.settled():
            return False
        self._settling.append(_Settling(job, flow, time.monotonic() + self._drain_s))
        return True

    def _settle(self, now: float) -> bool:
        """Close the parked links nothing settling is in flight on; hand back the blocks of every pull that
        settled, or whose time is up. Returns whether one did."""
        busy = {id(s.flow.link) for s in self._settling if not s.flow.settled()}
        self._transport.close_parked(now, lambda link: id(link) in busy)
        ended = [s for s in self._settling if s.flow.settled() or now >= s.until + SETTLE_S]
        for s in ended:
            if not s.flow.settled():
                log.warning("request %s: %d sends to %s still in flight %.0f s after its pull ended; its blocks go "
                            "back anyway", s.job.msg.request_id, s.flow.in_flight(), s.job.msg.consumer,
                            self._drain_s + SETTLE_S)
            self._settling.remove(s)
            self.claims.settled(s.job)
        return bool(ended)

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
