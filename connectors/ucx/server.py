"""The producer's UCX transfer server: answers pulls from consumers.

Lifecycle: `start()` binds a zmq ROUTER side channel and starts one thread that owns
the UCX transport. For each `PullRequest` it marks the held request in flight, posts
one tagged send per piece (a run of consecutive blocks, then each hidden tensor),
and when every send completes replies `PullReply(ok=True)` and releases the
request's blocks. Requests nobody pulls are released at their hold deadline.
Malformed messages are logged with the peer and dropped; the server keeps serving.
`close()` stops the thread and releases everything still held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from connectors.held import HeldRequest, HeldTable
from connectors.kv_region import KVRegion, plan_runs
from connectors.ucx.transport import MAX_PIECES, UCXTransport, all_done, check_errors
from connectors.wire import PullReply, PullRequest, WireError, decode, encode

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0  # upper bound between hold-deadline checks


@dataclass
class _Outgoing:
    identity: bytes
    msg: PullRequest
    held: HeldRequest
    requests: list
    deadline: float


class UCXTransferServer:
    def __init__(self, host: str, region: KVRegion, held: HeldTable, send_deadline_s: float,
                 trusted_endpoint: Callable[[str], bytes | None], on_expired: Callable[[str], None] | None = None):
        """Args:
        host: address the side channel binds.
        region: the pool's bytes.
        held: requests whose KV is waiting to be pulled.
        send_deadline_s: how long one pull's sends may take.
        trusted_endpoint: the transport address a consumer node published in the directory;
            pulls naming any other address are refused (UCX aborts on a malformed one).
        on_expired: called for a held request released at its hold deadline.
        """
        self._region = region
        self._trusted_endpoint = trusted_endpoint
        self._held = held
        self._send_deadline_s = send_deadline_s
        self._on_expired = on_expired or (lambda rid: None)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.side_channel = f"tcp://{host}:{port}"
        self._transport = UCXTransport()
        self.transport_address = self._transport.address
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self._outgoing: list[_Outgoing] = []
        self.rejected_messages = 0
        self._thread = threading.Thread(target=self._run, name="ucx-transfer-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout=5)
        self._sock.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._held.release_all()
        self._transport.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._transport.event_fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the server must outlive any one bad transfer
                log.exception("transfer server step failed")
            if self._transport.arm() and not self._outgoing_done():
                ready = dict(poller.poll(self._timeout_ms()))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)

    def _step(self) -> None:
        self._transport.progress()
        while self._sock.poll(0):
            self._handle(self._sock.recv_multipart(copy=False))
        self._finish_outgoing()
        for rid in self._held.expire_due(time.monotonic()):
            log.info("request %s: KV not pulled before its hold deadline; released", rid)
            self._on_expired(rid)

    def _outgoing_done(self) -> bool:
        return any(all_done(o.requests) for o in self._outgoing)

    def _timeout_ms(self) -> int:
        now = time.monotonic()
        wake = now + IDLE_WAKE_S
        nxt = self._held.next_deadline()
        if nxt is not None:
            wake = min(wake, nxt)
        for o in self._outgoing:
            wake = min(wake, o.deadline)
        return max(0, int((wake - now) * 1000) + 1)

    def _handle(self, frames: list) -> None:
        if len(frames) != 2:
            self._reject(frames[0].bytes if frames else b"?", f"{len(frames)} frames")
            return
        identity, payload = frames[0].bytes, frames[1].buffer
        try:
            msg = decode(payload, expect=PullRequest)
        except WireError as exc:
            self._reject(identity, str(exc))
            return
        self._start_pull(identity, msg)

    def _reject(self, identity: bytes, reason: str) -> None:
        self.rejected_messages += 1
        log.warning("side channel: rejected message from peer %s: %s", identity.hex(), reason)

    def _start_pull(self, identity: bytes, msg: PullRequest) -> None:
        held = self._held.begin_pull(msg.request_id)
        if held is None:
            self._reply(identity, msg, False, "request unknown, released or already being pulled")
            return
        src = held.location.block_ids
        if not self._is_trusted(msg):
            self._fail(identity, msg, f"transport address of {msg.consumer!r} is not the one it published")
            return
        if len(msg.dst_block_ids) != len(src):
            self._fail(identity, msg, f"{len(msg.dst_block_ids)} destination blocks for {len(src)} source blocks")
            return
        runs = plan_runs(src, msg.dst_block_ids)
        pieces = self._region.pieces([(s, n) for s, _, n in runs]) + held.hidden
        if len(pieces) > MAX_PIECES:
            self._fail(identity, msg, f"{len(pieces)} pieces exceed {MAX_PIECES}")
            return
        try:
            reqs = self._transport.post_sends(msg.transport_address, pieces, msg.transfer_id)
        except Exception as exc:  # noqa: BLE001 - a bad peer address must not kill the server
            self._fail(identity, msg, f"cannot send to consumer {msg.consumer}: {exc}")
            return
        deadline = time.monotonic() + self._send_deadline_s
        self._outgoing.append(_Outgoing(identity, msg, held, reqs, deadline))

    def _is_trusted(self, msg: PullRequest) -> bool:
        try:
            return self._trusted_endpoint(msg.consumer) == msg.transport_address
        except Exception as exc:  # noqa: BLE001 - no directory, no trust
            log.warning("request %s: cannot look up consumer %s: %s", msg.request_id, msg.consumer, exc)
            return False

    def _finish_outgoing(self) -> None:
        now = time.monotonic()
        still = []
        for o in self._outgoing:
            if all_done(o.requests):
                try:
                    check_errors(o.requests)
                    self._reply(o.identity, o.msg, True)
                except Exception as exc:  # noqa: BLE001
                    self._reply(o.identity, o.msg, False, f"send failed: {exc}")
                self._held.release(o.msg.request_id)
            elif now >= o.deadline:
                log.warning("request %s: sends to %s missed their deadline", o.msg.request_id, o.msg.consumer)
                self._transport.forget_peer(o.msg.transport_address)
                self._held.release(o.msg.request_id)
            else:
                still.append(o)
        self._outgoing = still

    def _fail(self, identity: bytes, msg: PullRequest, reason: str) -> None:
        log.warning("request %s: pull from %s refused: %s", msg.request_id, msg.consumer, reason)
        self._reply(identity, msg, False, reason)
        self._held.release(msg.request_id)

    def _reply(self, identity: bytes, msg: PullRequest, ok: bool, reason: str = "") -> None:
        reply = PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=ok, reason=reason)
        self._sock.send_multipart([identity, encode(reply)])
