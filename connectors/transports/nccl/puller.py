"""The consumer's half of the NCCL / Gloo transport: pull one request's KV into its blocks.

Lifecycle of one pull:

1. Find this consumer's link to the producer (its store connection and pair group); with
   no link, connect to the producer's store and open a pair under this pull's id. Links
   unused for `PAIR_IDLE_S` are reopened.
2. Send the `PullRequest`.
3. Start a receive thread that builds the pair's group if it is new (the producer builds
   its side when it serves the pull), posts one receive per piece straight into the
   destination blocks and hidden tensors, and waits for them with the pull's deadline.
4. Meanwhile this thread watches the side channel for the producer's reply and the
   receive thread's end. Success needs both.

On any failure the link is dropped (the next pull opens a new pair) and, if receives were
posted, `pull` returns only once they have ended: a Gloo wait that times out closes the
pair, so no byte lands in blocks the caller then reuses.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvwire.connectors.base import TransferError
from kvwire.connectors.control.side_channel import SideChannelClient
from kvwire.connectors.transports.kv_region import KVRegion, consumer_pieces
from kvwire.connectors.transports.nccl.pairs import (
    CONSUMER,
    MAX_PIECES,
    Backend,
    GroupFactory,
    PairGroup,
    backend_for,
    connect_store,
    consumer_key,
    detached,
    open_key,
    pair_prefix,
)
from kvwire.connectors.transports.transport import ConfirmedPulls
from kvwire.connectors.wakeup import Wakeup
from kvwire.connectors.wire import KVLocation, PullRequest

log = logging.getLogger(__name__)

PAIR_IDLE_S = 300.0  # the producer retires an idle lane later (LANE_IDLE_S), so we reopen first
JOIN_GRACE_S = 1.0  # receive waits end at the deadline; allow this much more for them to unwind


@dataclass(eq=False)
class _Link:
    """This consumer's pair with one producer."""

    store: dist.TCPStore
    opened: int  # id of the pull that opened the pair: names its store prefix
    group: PairGroup | None = None  # set once built
    last_used: float = field(default_factory=time.monotonic)


class NCCLPuller(ConfirmedPulls):
    def __init__(self, node_id: str, host: str, region: KVRegion):
        """Args:
        node_id: this consumer's name (sent in every PullRequest).
        host: address this side's Gloo device binds.
        region: the pool's bytes (its device picks NCCL or Gloo).
        """
        self._node_id = node_id
        self._region = region
        self._factory = GroupFactory(host, region.planes[0].device)
        self._address = f"{node_id}/{uuid.uuid4().hex}".encode()  # unique per incarnation
        self._key = consumer_key(self._address)
        self._channel = SideChannelClient()
        self._links: dict[bytes, _Link] = {}
        self._transfer_ids = itertools.count(1)
        self._wakeup = Wakeup()
        self._wake_lock = threading.Lock()
        self._closed = False

    @property
    def transport_address(self) -> bytes:
        return self._address

    @property
    def backend(self) -> Backend:
        """Gloo for a CPU pool (TCP sockets), NCCL for a CUDA pool (NCCL picks its own path)."""
        return backend_for(self._region.planes[0].device)

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int:
        """Receive `loc`'s blocks into `dst_blocks` and its hidden tensors into `hidden`.

        Returns:
            Bytes received.
        Raises:
            TransferError: refused, failed, or not complete by `deadline`.
        """
        pieces = consumer_pieces(self._region, loc, dst_blocks, hidden, MAX_PIECES)
        transfer_id = next(self._transfer_ids)
        link = self._link_for(loc, transfer_id, deadline)
        rx = _Receive(self._factory, link, pair_prefix(self._key, link.opened), pieces, transfer_id, deadline,
                      self._wake)
        try:
            self._channel.send(loc.side_channel, PullRequest(
                request_id=loc.request_id, transfer_id=transfer_id, consumer=self._node_id,
                transport_address=self._address, dst_block_ids=dst_blocks, first_block=loc.first_block,
                src_block_ids=loc.block_ids, block_size=loc.pull_block_size,
                heads=loc.heads))
            rx.start()
            self._channel.wait(loc, transfer_id, deadline, fds=[self._wakeup.fd],
                               progress=lambda: self._check(loc, rx), done=rx.succeeded)
        except BaseException as exc:
            self._give_up(loc, link, rx, deadline)
            if isinstance(exc, (TransferError, KeyboardInterrupt)):
                raise
            raise TransferError(loc.request_id, loc.producer, f"receive failed: {exc}") from exc
        link.last_used = time.monotonic()
        return sum(p.numel() * p.element_size() for p in pieces)

    def close(self) -> None:
        with self._wake_lock:
            self._closed = True
            self._wakeup.close()
        for addr in list(self._links):
            self._drop(addr)
        self._channel.close()

    def _link_for(self, loc: KVLocation, transfer_id: int, deadline: float) -> _Link:
        """This consumer's link to `loc`'s producer, connected and opened if new.

        Raises:
            TransferError: the producer's store cannot be reached.
        """
        addr = loc.transport_address
        link = self._links.get(addr)
        if link is not None and time.monotonic() - link.last_used > PAIR_IDLE_S:
            self._drop(addr)
            link = None
        if link is not None:
            return link
        try:
            store = connect_store(addr, deadline)
            store.set(open_key(self._key), str(transfer_id))  # read by the producer's lane when it serves the pull
        except (OSError, ValueError, RuntimeError) as exc:
            raise TransferError(loc.request_id, loc.producer, f"cannot open a pair with the producer: {exc}") from exc
        link = self._links[addr] = _Link(store, transfer_id)
        return link

    def _check(self, loc: KVLocation, rx: _Receive) -> None:
        self._wakeup.drain()
        if rx.error is not None:
            raise TransferError(loc.request_id, loc.producer, f"receive failed: {rx.error}")

    def _give_up(self, loc: KVLocation, link: _Link, rx: _Receive, deadline: float) -> None:
        if self._links.get(loc.transport_address) is link:
            self._drop(loc.transport_address)
        if rx.cancel() and not rx.ended.wait(max(0.0, deadline - time.monotonic()) + JOIN_GRACE_S):
            log.error("request %s: receives from %s still pending after the deadline", loc.request_id, loc.producer)

    def _drop(self, addr: bytes) -> None:
        link = self._links.pop(addr, None)
        if link is not None and link.group is not None:
            link.group.discard()
            link.group = None

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._closed:
                self._wakeup.wake()


class _Receive:
    """One pull's receives, on a thread of their own so the side channel stays watched."""

    def __init__(self, factory: GroupFactory, link: _Link, prefix: str, pieces: list[torch.Tensor],
                 transfer_id: int, deadline: float, wake: Callable[[], None]):
        self._factory, self._link, self._prefix = factory, link, prefix
        self._pieces, self._transfer_id, self._deadline = pieces, transfer_id, deadline
        self._wake = wake
        self._lock = threading.Lock()
        self._cancelled = False
        self._posted = False
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-nccl-recv", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> bool:
        """Stop before posting; True if receives are already posted and have not ended."""
        with self._lock:
            self._cancelled = True
            return self._posted and not self.ended.is_set()

    def succeeded(self) -> bool:
        return self.ended.is_set() and self.error is None

    def _run(self) -> None:
        group = self._link.group
        try:
            if group is None:
                group = self._factory.build(self._link.store, self._prefix, CONSUMER, self._deadline)
            self._receive(group)
        except Exception as exc:  # noqa: BLE001 - reported to the pulling thread
            self.error = detached(exc)  # its frames would keep the operations, and the pair, alive
            if group is not None:
                group.discard()
            self._link.group = None
        finally:
            self.ended.set()
            self._wake()

    def _receive(self, group: PairGroup) -> None:
        with self._lock:
            if self._cancelled:
                raise RuntimeError("the pull was given up before its receives were posted")
            self._link.group = group
            works = group.post_recvs(self._pieces, self._transfer_id)
            self._posted = True
        group.wait_all(works, self._deadline)
