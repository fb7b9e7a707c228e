"""The producer's transfer server, one per transport it serves over: answers consumers' pulls.

A pull here:

1. `start()` has bound a zmq ROUTER side channel and started the one thread that owns the
   transport's send engine.
2. A `PullRequest` arrives. It is granted when the request is held and not already in
   flight, the consumer's transport address is the one that consumer published in the
   directory, and the block counts match; otherwise it is refused (`PullReply` not ok)
   and the request stays pullable by its real consumer.
3. The pieces are planned (one per run of blocks consecutive on both sides, per plane,
   then each hidden tensor) and the send engine is handed a `SendJob`.
4. When the engine finishes the job, the server replies `PullReply`, the held table
   releases the request's blocks, and a successful pull is reported (`on_delivered`).
   A job past its deadline is abandoned and answered. A failed or abandoned job whose
   sends the transport may still be reading (UCX: a link left open until it fails,
   ucx/worker.py `park`) keeps its blocks until the engine says it is `settled`: a
   consumer takes completed receives as the whole proof (ucx/puller.py), so a send that
   lands late must still read the request's bytes.

Requests nobody pulls are released at their hold deadline (`on_expired`). Malformed
messages are logged with the peer, counted and dropped. `close()` stops the thread and the
engine, and releases everything still held.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from kvwire.connectors.control.auth import AuthError
from kvwire.connectors.control.framing import pack, peek_request, unpack
from kvwire.connectors.control.sockets import LINGER_MS, limit_receive
from kvwire.connectors.producer.held import HeldRequest, HeldTable
from kvwire.connectors.spin import Spin
from kvwire.connectors.transports.kv_region import KVRegion, plan_runs
from kvwire.connectors.transports.transport import Refused, SendEngine, SendJob
from kvwire.connectors.wakeup import Wakeup
from kvwire.connectors.wire import PullReply, PullRequest, WireError

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0  # upper bound between hold-deadline checks
MAX_WARNED = 1024  # (peer, reason) rejections remembered as logged
TRUST_TTL_S = 5.0  # a consumer's verified transport address is trusted this long without a lookup


class TransferServer:
    """The `Claims` its send engine is bound to (connectors/transports/transport.py)."""

    def __init__(self, host: str, region: KVRegion, held: HeldTable, engine: SendEngine, send_deadline_s: float,
                 trusted_address: Callable[[str], bytes | None], on_expired: Callable[[str], None] | None = None,
                 on_delivered: Callable[[PullRequest, int], None] | None = None, advertise_host: str | None = None):
        """Args:
        host: address the side channel binds.
        region: the pool's bytes.
        held: requests whose KV is waiting to be pulled.
        engine: the transport's send engine.
        send_deadline_s: how long one pull may take once granted.
        trusted_address: the transport address a consumer published in the directory;
            pulls naming any other address are refused (UCX aborts on a malformed one).
        on_expired: called for a held request released at its hold deadline.
        on_delivered: called with the pull and its bytes once a pull is confirmed to its consumer
            (the directory bookkeeping then happens here, off the consumer's path to its first token).
        advertise_host: the address consumers reach the side channel at (published); None: host.
        """
        self._region, self._held, self._engine = region, held, engine
        self._send_deadline_s = send_deadline_s
        self._trusted_endpoint = trusted_address
        self._trusted: dict[str, tuple[bytes, float]] = {}  # consumer -> (verified address, when)
        self._on_expired = on_expired or (lambda rid: None)
        self._on_delivered = on_delivered or (lambda msg, nbytes: None)
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        limit_receive(self._sock)
        self.side_channel = f"tcp://{advertise_host or host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._wakeup = Wakeup()
        self._stop = threading.Event()
        self._jobs: dict[tuple[str, str, int], SendJob] = {}  # (request, consumer, its transfer id)
        self._finished: queue.SimpleQueue[tuple[SendJob, BaseException | None, bool]] = queue.SimpleQueue()
        self._settled: queue.SimpleQueue[SendJob] = queue.SimpleQueue()
        # answered jobs whose blocks the engine may still read, with how they failed
        self._settling: dict[tuple[str, str, int], tuple[SendJob, BaseException]] = {}
        self.rejected_messages = 0
        self._warned: set[tuple[bytes, str]] = set()  # (peer, reason) rejections logged
        engine.bind(self)
        self.transport_address = engine.transport_address
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wakeup.wake()

    def finish(self, job: SendJob, error: BaseException | None, settling: bool = False) -> None:
        """The engine is done with `job` (error None on success); `settling`: it may still read the job's pieces,
        whose blocks stay held until `settled(job)`. Thread-safe."""
        self._finished.put((job, error, settling))
        self._wakeup.wake()

    def settled(self, job: SendJob) -> None:
        """The engine no longer reads the pieces of `job`, finished or abandoned as settling. Thread-safe."""
        self._settled.put(job)
        self._wakeup.wake()

    @property
    def settling(self) -> int:
        """Answered pulls whose blocks stay held while the transport may still read them."""
        return len(self._settling)

    def close(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread.is_alive():  # closed without start(): nothing to join
            self._thread.join(timeout=5)
        self._sock.close(LINGER_MS)  # the last replies still go out: a consumer waiting on one would time out
        self._engine.close()
        self._wakeup.close()
        self._held.release_all()

    def _run(self) -> None:
        poller = zmq.Poller()
        for fd in [self._sock, self._wakeup.fd, *self._engine.fds()]:
            poller.register(fd, zmq.POLLIN)
        spin = Spin()
        while not self._stop.is_set():
            moved = True
            try:
                moved = self._step()
            except Exception:  # noqa: BLE001 - the server must outlive any one bad transfer
                log.exception("transfer server step failed")
            if self._engine.can_block() and self._finished.empty():
                poller.poll(self._timeout_ms())
                self._wakeup.drain()
                spin.reset()
            else:
                spin.pause(moved)  # yields while transfers move, naps while they wait on a peer

    def _step(self) -> bool:
        """One turn; returns whether anything moved (a transfer, a message, a finished job)."""
        moved = self._engine.progress()
        while self._sock.poll(0):
            self._handle(self._sock.recv_multipart(copy=False))
            moved = True
        while not self._finished.empty():
            self._complete(*self._finished.get())
            moved = True
        while not self._settled.empty():  # after every finish queued before it
            if (ended := self._settling.pop(_key(self._settled.get()), None)) is not None:
                self._release(*ended)
            moved = True
        now = time.monotonic()
        for job in [j for j in self._jobs.values() if j.deadline <= now]:
            log.warning("request %s: pull by %s missed its deadline", job.msg.request_id, job.msg.consumer)
            self._complete(job, TimeoutError("pull missed its deadline"), settling=self._engine.abandon(job))
        for rid in self._held.expire_due(now):
            log.info("request %s: KV not pulled before its hold deadline; released", rid)
            self._on_expired(rid)
        return moved

    def _timeout_ms(self) -> int:
        now = time.monotonic()
        wake = min([now + IDLE_WAKE_S, *(j.deadline for j in self._jobs.values())])
        nxt = self._held.next_deadline()
        if nxt is not None:
            wake = min(wake, nxt)
        return max(0, int((wake - now) * 1000) + 1)

    def _handle(self, frames: list) -> None:
        if len(frames) != 2:
            self._reject(frames[0].bytes if frames else b"?", f"{len(frames)} frames")
            return
        identity, payload = frames[0].bytes, frames[1].buffer
        try:
            msg = unpack(payload, expect=PullRequest)
        except AuthError as exc:  # answered, so that a consumer with another secret fails now, not at its deadline
            self._reject(identity, str(exc), once=True)
            self._refuse_unsealed(identity, payload, str(exc))
            return
        except WireError as exc:
            self._reject(identity, str(exc))
            return
        self._start_pull(identity, msg)

    def _reject(self, identity: bytes, reason: str, once: bool = False) -> None:
        """Counted every time; logged every time, or with `once` (unsealed: a stranger may send a flood of them)
        once per peer (a zmq identity) and reason, for a bounded number of them."""
        self.rejected_messages += 1
        if once:
            key = (identity, reason.split(" (")[0])
            if key in self._warned or len(self._warned) >= MAX_WARNED:
                return
            self._warned.add(key)
        log.warning("side channel: rejected message from peer %s: %s%s", identity.hex(), reason,
                    " (said once per peer)" if once else "")

    def _refuse_unsealed(self, identity: bytes, payload: memoryview, reason: str) -> None:
        """A sealed refusal of a pull request whose seal did not hold, addressed by what its bytes say (a refusal
        carries nothing the sender could not read in its own request); nothing when they say nothing."""
        request = peek_request(payload)
        if request is not None:
            self._reply(identity, request, False, f"unauthenticated: {reason}")

    def _start_pull(self, identity: bytes, msg: PullRequest) -> None:
        if msg.abandon:
            self._abandoned(identity, msg)
            return
        job = self.claim(msg, identity)
        if isinstance(job, Refused):
            self._reply(identity, msg, False, job.reason)
            return
        if msg.heads is not None and msg.heads.num_heads == 0:  # declined: nothing moves, one puller less
            self._complete(job, None)
            return
        try:
            self._engine.start(job)
        except Exception as exc:  # noqa: BLE001 - a bad peer must not kill the server
            self._complete(job, exc)

    def _abandoned(self, identity: bytes, msg: PullRequest) -> None:
        """`msg`'s consumer will not pull its request: its pull ends, failed, before it began (the blocks go once
        every puller's has). Only the consumer the request's address belongs to may say so."""
        refusal = self._distrust(msg.consumer, msg.transport_address)
        pullers = msg.heads.pullers if msg.heads is not None else 1
        if not refusal and self._held.begin_pull(msg.request_id, msg.consumer, pullers) is None:
            refusal = "request unknown, released, being pulled, or pulled by this consumer"
        if refusal:
            self._reply(identity, msg, False, refusal)
            return
        released = self._held.finish_pull(msg.request_id, msg.consumer)
        log.info("request %s: %s will not pull it%s", msg.request_id, msg.consumer, "; released" if released else "")
        self._reply(identity, msg, True)

    def claim(self, msg: PullRequest, identity: bytes = b"") -> SendJob | Refused:
        """Let `msg` pull its request, if it may: the request is then in flight until `finish`.

        Server thread only. Engines that take pulls on their own channel (shared memory)
        call this themselves and answer on that channel (`job.replied` set).
        Returns:
            The job, or why the pull is refused.
        """
        pullers = msg.heads.pullers if msg.heads is not None else 1
        held = self._held.begin_pull(msg.request_id, msg.consumer, pullers)
        if held is None:
            return Refused("request unknown, released, already being pulled, or pulled by this consumer")
        reason = self._refusal(msg, held)
        if reason:
            log.warning("request %s: pull from %s refused: %s", msg.request_id, msg.consumer, reason)
            self._held.end_pull(msg.request_id, msg.consumer)  # a stranger must not make us drop the real KV
            return Refused(reason)
        runs = [(s, n) for s, _, n in plan_runs(_sources(msg, held), msg.dst_block_ids)]
        region = self._region
        if msg.heads is not None:
            region = region.heads(msg.heads.src_head, msg.heads.num_heads, msg.heads.per_block)
        if msg.block_size:
            region = region.sub_blocks(msg.block_size)
        job = SendJob(identity, msg, held, region, runs, time.monotonic() + self._send_deadline_s)
        self._jobs[_key(job)] = job
        return job

    def _distrust(self, consumer: str, address: bytes) -> str:
        """Why `address` is not trusted as `consumer`'s ("" when it is): it must be what `consumer` published.

        A match is remembered for TRUST_TTL_S (a directory round trip saved per pull); after that it is looked up
        again. A lookup that fails (the directory timed out: a stalled redis-server) keeps the address this
        consumer was last verified with, since nothing says it changed; a consumer never verified is refused.
        """
        now = time.monotonic()
        known, when = self._trusted.get(consumer, (b"", 0.0))
        if known == address and now - when < TRUST_TTL_S:
            return ""
        try:
            published = self._trusted_endpoint(consumer)
        except Exception as exc:  # noqa: BLE001 - no directory: only what was verified before
            if known == address:
                log.warning("cannot look up consumer %s (%s); its last verified address stands", consumer, exc)
                return ""
            return f"cannot verify the transport address of {consumer!r}: {exc}"
        if published != address:
            self._trusted.pop(consumer, None)  # it moved (restarted): the old address is no fallback
            return f"transport address of {consumer!r} is not the one it published"
        self._trusted[consumer] = (address, now)
        return ""

    def _refusal(self, msg: PullRequest, held: HeldRequest) -> str:
        if reason := self._distrust(msg.consumer, msg.transport_address):
            return reason
        if held.gate is not None and not (self._engine.streams_layers and msg.layer_major):
            return "layer-wise KV needs a transport and a consumer that stream layer by layer"
        if held.gate is not None and held.gate.failure:
            return f"prefill failed: {held.gate.failure}"
        if reason := _source_refusal(msg, held):
            return reason
        if msg.heads is not None:
            try:
                self._region.heads(msg.heads.src_head, msg.heads.num_heads, msg.heads.per_block)
            except ValueError as exc:
                return f"head slice {msg.heads}: {exc}"
        if msg.block_size:
            region = self._region
            try:
                if msg.heads is not None:
                    region = region.heads(msg.heads.src_head, msg.heads.num_heads, msg.heads.per_block)
                region.sub_blocks(msg.block_size)
            except ValueError as exc:
                return f"blocks of {msg.block_size} tokens: {exc}"
            if held.gate is not None:
                return "layer-wise KV is not served in blocks of another size"
            if held.gate is not None or held.hidden:
                return "a head slice of layer-wise KV or of hidden states is not served"
        return ""

    def _complete(self, job: SendJob, error: BaseException | None, settling: bool = False) -> None:
        """Answer `job`'s consumer and end its pull; with `settling`, its blocks stay held until `settled`."""
        if self._jobs.pop(_key(job), None) is None:
            return  # finished already (e.g. abandoned, then the engine reported)
        if error is not None:
            log.warning("request %s: send to %s failed: %s", job.msg.request_id, job.msg.consumer, error)
        if not job.replied:
            self._reply(job.identity, job.msg, error is None, "" if error is None else f"send failed: {error}")
        if settling:
            assert error is not None, "a pull that succeeded has no send in flight"
            self._settling[_key(job)] = (job, error)
            return
        self._release(job, error)

    def _release(self, job: SendJob, error: BaseException | None) -> None:
        """`job`'s pull is over: its blocks go once every puller's pull is."""
        released = self._held.finish_pull(job.msg.request_id, job.msg.consumer)
        if error is None and released:  # the last puller: the entry is consumed (others may still need it)
            self._on_delivered(job.msg, job.nbytes)

    def _reply(self, identity: bytes, msg: PullRequest, ok: bool, reason: str = "") -> None:
        reply = PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=ok, reason=reason)
        self._sock.send_multipart([identity, pack(reply)])


def _key(job: SendJob) -> tuple[str, str, int]:
    """A pull's name among the server's jobs: its request, its consumer, and that consumer's transfer id."""
    return job.msg.request_id, job.msg.consumer, job.msg.transfer_id


def _held_blocks(msg: PullRequest, held: HeldRequest) -> list[int]:
    """The blocks held for the request, as `msg` counts them: the location's, or each of them as the blocks of
    `msg.block_size` tokens it holds (sub-block `b * ratio + i` is the i-th of block b), as many as hold tokens."""
    blocks = held.location.block_ids
    if not msg.block_size or msg.block_size == held.location.layout.block_size:
        return blocks
    ratio = held.location.layout.block_size // msg.block_size
    return [b * ratio + i for b in blocks for i in range(ratio)][:-(-held.location.num_tokens // msg.block_size)]


def _sources(msg: PullRequest, held: HeldRequest) -> list[int]:
    """The held blocks `msg` asks for, in its destination order (`_source_refusal` passed)."""
    return msg.src_block_ids or _held_blocks(msg, held)[msg.first_block:]


def _source_refusal(msg: PullRequest, held: HeldRequest) -> str:
    """Why `msg`'s source blocks cannot be sent ("" if they can): a pick of blocks not held for the request
    (a consumer never reads other memory), a count unlike its destination's."""
    blocks = _held_blocks(msg, held)
    if msg.src_block_ids:
        if not set(msg.src_block_ids) <= set(blocks):
            return "source blocks not held for this request"
        sources = len(msg.src_block_ids)
    elif msg.first_block < 0:
        return f"first block {msg.first_block}"
    else:
        sources = len(blocks) - msg.first_block
    if len(msg.dst_block_ids) != sources:
        return f"{len(msg.dst_block_ids)} destination blocks for {sources} source blocks"
    return ""
