"""The producer's half of the NCCL / Gloo transport: one lane per consumer.

Lifecycle:

1. The engine hosts the pair rendezvous store (its transport address).
2. `start(job)` (server thread, never blocks) queues the job on its consumer's lane,
   created on that consumer's first pull. A lane is one thread, with its own store
   connection (a store client serialises its calls, and a rendezvous with a dead
   consumer blocks until the job's deadline), that serves its consumer's pulls in order.
3. For each job the lane reads which pull opened the consumer's current pair from the
   store, builds the pair's group as rank 0 if it has not built that one yet, sends every
   piece (whole KV runs, then hidden tensors), waits for all of them with the job's
   deadline, and reports to the server. Any failure discards the group before it is
   reported, so a consumer that hears of a failure knows nothing more will be written
   into its blocks.
4. A lane idle for `LANE_IDLE_S` discards its group and ends.
5. `close()` ends every lane and the store.

`abandon(job)` (deadline) marks the job and waits briefly for the lane to stop touching it; a lane still sending
after that keeps the job's blocks held until it stops (`Claims.settled`).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch.distributed as dist

from kvwire.connectors.base import TransferError
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.nccl.pairs import (
    MAX_PIECES,
    PRODUCER,
    GroupFactory,
    PairGroup,
    consumer_key,
    detached,
    host_store,
    open_key,
    pair_prefix,
)
from kvwire.connectors.transports.transport import SendEngine, SendJob

log = logging.getLogger(__name__)

LANE_IDLE_S = 600.0  # longer than the consumer's PAIR_IDLE_S, so the consumer reopens first
ABANDON_WAIT_S = 2.0  # a lane's waits end at the job's deadline, which has passed when it is abandoned
CLOSE_WAIT_S = 5.0


@dataclass(eq=False)
class _JobState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    running: bool = False
    ended: threading.Event = field(default_factory=threading.Event)
    settles: bool = False  # abandoned while its lane still sent: the lane says `settled` once it stops


class NCCLSendEngine(SendEngine):
    def __init__(self, host: str, region: KVRegion, store_timeout_s: float):
        """Args:
        host: address the rendezvous store and the Gloo device bind.
        region: the pool's bytes (its device picks NCCL or Gloo).
        store_timeout_s: bound on this process's own store operations.
        """
        self.factory = GroupFactory(host, region.planes[0].device)
        self.store: dist.TCPStore | None
        self.store, self.transport_address = host_store(host, store_timeout_s)
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()

    def start(self, job: SendJob) -> None:
        if job.num_pieces > MAX_PIECES:
            raise ValueError(f"{job.num_pieces} pieces exceed {MAX_PIECES}")
        job.state = _JobState()
        key = consumer_key(job.msg.transport_address)
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(self, key, job.msg.consumer)
            lane.jobs.put(job)

    def abandon(self, job: SendJob) -> bool:
        state = job.state
        assert isinstance(state, _JobState)  # set by start()
        with state.lock:
            state.abandoned = True
            running = state.running
        if not running or state.ended.wait(ABANDON_WAIT_S):
            return False
        with state.lock:
            state.settles = not state.ended.is_set()
        if state.settles:
            log.error("request %s: lane for %s still sending %.1fs after the deadline; its blocks stay held until it "
                      "stops", job.msg.request_id, job.msg.consumer, ABANDON_WAIT_S)
        return state.settles

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.jobs.put(None)
        for lane in lanes:
            lane.thread.join(CLOSE_WAIT_S)
        self.store = None

    def retire(self, lane: _Lane) -> bool:
        """An idle lane asks to end; False if a job arrived meanwhile."""
        with self._lock:
            if not lane.jobs.empty():
                return False
            if self._lanes.get(lane.key) is lane:
                del self._lanes[lane.key]
            return True


class _Lane:
    """One consumer's pair on this producer, and the thread that sends to it."""

    def __init__(self, engine: NCCLSendEngine, key: str, consumer: str):
        self.key = key
        self.jobs: queue.SimpleQueue[SendJob | None] = queue.SimpleQueue()
        self._engine = engine
        self._consumer = consumer
        self._store: dist.Store | None = None  # this lane's own connection: a store client serialises its calls
        self._group: PairGroup | None = None
        self._built = 0  # open id of the last group built (or tried): a prefix is never built twice
        self.thread = threading.Thread(target=self._run, name=f"kv-nccl-lane-{consumer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            store = self._engine.store
            assert store is not None  # the engine starts no lane once closed
            self._store = store.clone()  # type: ignore[attr-defined]  # torch's stubs omit TCPStore.clone
        except RuntimeError as exc:  # every job of this lane then fails, each with this reason
            log.error("lane for consumer %s: cannot connect to the rendezvous store: %s", self._consumer, exc)
        while True:
            try:
                job = self.jobs.get(timeout=LANE_IDLE_S)
            except queue.Empty:
                if self._engine.retire(self):
                    break
                continue
            if job is None:
                break
            self._serve(job)
        self._discard()
        self._store = None

    def _serve(self, job: SendJob) -> None:
        state = job.state
        assert isinstance(state, _JobState)  # set by start()
        with state.lock:
            if state.abandoned:
                return  # the server has already answered it
            state.running = True
        error: BaseException | None = None
        try:
            group = self._group_for(job)
            group.wait_all(group.post_sends(job.pieces(), job.msg.transfer_id), job.deadline)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the server
            detached(exc)  # its frames would keep the sends, and with them the pair, alive
            self._discard()
            error = TransferError(job.msg.request_id, job.msg.consumer, f"{type(exc).__name__}: {exc}")
        finally:
            with state.lock:
                state.ended.set()
                settles = state.settles
        self._engine.claims.finish(job, error)
        if settles:
            self._engine.claims.settled(job)

    def _group_for(self, job: SendJob) -> PairGroup:
        """The group of the pair the consumer opened for this pull, built if new.

        Raises:
            RuntimeError: the consumer opened no pair, has reopened since (a stale pull),
                or this side already dropped that pair; or building it failed.
        """
        opened = self._read_open(job)
        if opened > job.msg.transfer_id:
            raise RuntimeError(f"pull {job.msg.transfer_id} is stale: the consumer reopened the pair at {opened}")
        if opened == self._built and self._group is not None:
            return self._group
        if opened <= self._built:
            raise RuntimeError(f"pair {opened} was already dropped here; the consumer must reopen it")
        self._discard()
        self._built = opened
        assert self._store is not None  # _read_open checked it
        self._group = self._engine.factory.build(self._store, pair_prefix(self.key, opened), PRODUCER, job.deadline)
        log.info("pair with consumer %s built (pair %d)", self._consumer, opened)
        return self._group

    def _read_open(self, job: SendJob) -> int:
        store, key = self._store, open_key(self.key)
        if store is None or not store.check([key]):
            raise RuntimeError(f"consumer {job.msg.consumer} opened no pair before pulling")
        raw = store.get(key)
        if not raw.isdigit():
            raise RuntimeError(f"consumer {job.msg.consumer} wrote a malformed pair id")
        return int(raw)

    def _discard(self) -> None:
        if self._group is not None:
            self._group.discard()
            self._group = None
