"""A consumer's UCX lanes: several workers that read one pull's pieces on several cores.

One UCX transfer's bytes are moved by whoever progresses the receiving worker: with
cross-memory attach, each progress call copies the pieces whose rendezvous arrived
(process_vm_readv, in this process, on this thread). One worker is one core, and one
core's copy does not saturate memory: two lanes read a request faster than one, even
on a 2-core host (docs/BENCHMARKS.md).

Lifecycle:

1. `ReceiveLanes(n)` makes n workers and n - 1 lane threads, which sleep between pulls,
   and each lane's staging slots for packs: host memory, or on a device pool's device
   (device-sized, packing.py). The packed `address` tells a producer how many lanes there
   are and where.
2. `post` posts every lane's receives (message i on lane i mod n: a `ReceiveFlow` each,
   flows.py) and wakes the threads; each advances its lane's flow (polls its worker,
   unpacks what came packed) until it is done, then sleeps again.
3. The caller polls lane 0 through `progress` until `done`.
4. `stop` (after a failure) makes the threads let go of their workers and cancels what is
   still posted on every lane.
5. `close` ends the threads and the workers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvwire.connectors.spin import Spin
from kvwire.connectors.transports.data_path import DataPath
from kvwire.connectors.transports.kv_region import Part
from kvwire.connectors.transports.ucx.flows import ReceiveFlow
from kvwire.connectors.transports.ucx.packing import DEVICE_PACK_BYTES, Staging, tensor_slots
from kvwire.connectors.transports.ucx.worker import MAX_LANES, Role, UCXWorker, pack_lanes

WAIT_SLICE_S = 0.001  # how long the caller sleeps on a busy lane thread before it looks at its side channel again
LANE_SLOTS = 4  # staging slots per lane: packs being received or unpacked at once


class _LaneThread:
    """Advances one lane's flow while it has receives in flight; sleeps otherwise."""

    def __init__(self, transport: UCXWorker, name: str):
        self._transport = transport
        self._flow: ReceiveFlow | None = None
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, flow: ReceiveFlow) -> None:
        assert self._idle.is_set(), "a lane takes one pull at a time"
        self._flow, self._stop, self.error = flow, False, None
        self._idle.clear()
        self._wake.set()

    @property
    def idle(self) -> bool:
        return self._idle.is_set()

    def wait_idle(self, timeout_s: float) -> bool:
        return self._idle.wait(timeout_s)

    def stop(self) -> None:
        """Return once the thread no longer touches the worker."""
        self._stop = True
        self._idle.wait()

    def close(self) -> None:
        self.stop()
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                flow = self._flow
                assert flow is not None  # start() set it before waking the thread
                spin = Spin()
                while not self._stop and not flow.done():
                    spin.pause(flow.advance())
                self._transport.progress()  # flush our last acknowledgements
            except BaseException as exc:  # noqa: BLE001 - handed to the pulling thread
                self.error = exc
            finally:
                self._idle.set()


class ReceiveLanes:
    def __init__(self, lanes: int, device: torch.device | None = None):
        """Args:
        lanes: workers (1..MAX_LANES).
        device: where packs land: None, host memory (slots of PACK_BYTES, for a host pool's threshold); a
            device, slots of DEVICE_PACK_BYTES there (for a device pool's; the CPU stands in for one in tests).
        Raises:
            ValueError: `lanes` out of range.
        """
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
        device_pool = device is not None and device.type == "cuda"
        self._transports = [UCXWorker(Role.CONSUMER, device_pool) for _ in range(lanes)]
        self._staging = [Staging(LANE_SLOTS) if device is None else
                         Staging(LANE_SLOTS, DEVICE_PACK_BYTES, tensor_slots(device)) for _ in range(lanes)]
        self._threads = [_LaneThread(t, f"kv-ucx-lane-{i}") for i, t in enumerate(self._transports[1:], 1)]
        self._flows: list[ReceiveFlow] = []
        self.address = pack_lanes([t.address for t in self._transports])

    def post(self, producer: bytes, parts: Sequence[Part], transfer_id: int, pack_below: int = 0,
             layer_pieces: int = 0, guarded: bool = True) -> None:
        """Post every lane's receives for the producer's worker at `producer` (pieces smaller than
        `pack_below` come packed, no pack across a multiple of `layer_pieces`; `guarded`: endpoint error handling on,
        another host, worker.py); set the lane threads going."""
        n = len(self._transports)
        self._flows = [ReceiveFlow(t, producer, parts, transfer_id, pack_below, s, lane, n, layer_pieces, guarded)
                       for lane, (t, s) in enumerate(zip(self._transports, self._staging))]
        for thread, flow in zip(self._threads, self._flows[1:]):
            thread.start(flow)

    def connect(self, producer: bytes, guarded: bool = True) -> None:
        """Make every lane's endpoint to the producer's worker at `producer` now (kept for later pulls), before the
        producer is asked to send: a lane that cannot reach it (UCX: "Destination is unreachable", say a worker made
        while its network device was down) fails the pull here, and the producer never connects to lanes that are
        replaced at once (`puller._fence`).

        Raises:
            UCXError: UCX could not make an endpoint.
            ValueError: `producer` is not a well-formed address.
        """
        for t in self._transports:
            t.link(producer, guarded)

    def path_to(self, producer: bytes, guarded: bool = True) -> DataPath:
        """What UCX selected between lane 0 and the producer's worker at `producer` (every lane's the same)."""
        return self._transports[0].path_to(producer, guarded)

    def progress(self) -> bool:
        """Advance lane 0 (the caller's own); once it is complete, wait a little for another lane instead,
        so that the caller does not spin on a core the lane threads need. Returns whether anything moved
        (a wait for a lane counts: it did not spin)."""
        if not self._flows[0].done():
            return self._flows[0].advance()
        busy = next((t for t in self._threads if not t.idle), None)
        if busy is not None:
            busy.wait_idle(WAIT_SLICE_S)
        return True

    def flush(self) -> None:
        """One more poll of lane 0 after `done`: sends our last acknowledgements (the lane threads do their own)."""
        self._transports[0].progress()

    def done(self) -> bool:
        return (not self._flows or self._flows[0].done()) and all(t.idle for t in self._threads)

    def check_errors(self) -> None:
        """Raise the first error of a lane thread or a completed receive (call once `done`)."""
        for thread in self._threads:
            if thread.error is not None:
                raise thread.error
        for flow in self._flows:
            flow.check_errors()

    def summary(self) -> str:
        """Each lane's flow's `summary` (a DEBUG line's)."""
        return "; ".join(f"lane {k}: {flow.summary()}" for k, flow in enumerate(self._flows))

    def stop(self, producer: bytes) -> int:
        """After a failure: stop the lane threads, then cancel whatever is still posted on any lane and
        drop the staging slots it used. Returns how many receives were still posted (now cancelled)."""
        for thread in self._threads:
            thread.stop()
        posted = sum(flow.in_flight() for flow in self._flows)
        for t in self._transports:
            t.abandon(producer)
        for flow in self._flows:
            flow.discard_slots()
        self._flows = []
        return posted

    def close(self) -> None:
        for thread in self._threads:
            thread.close()
        for t in self._transports:
            t.close()
