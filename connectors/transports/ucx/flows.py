"""One pull's UCX messages on each side: what is posted, what is in flight, what is left.

Lifecycle on the producer (`SendFlow`, one per pull, on the server thread):

1. Built when the pull is granted, it posts its messages in order: an unpacked piece
   zero-copy from the blocks, a pack (packing.py) once a staging slot is free (copy the
   pieces in, on the device for a device slot, and wait for the copy; send the slot).
   Message i goes to the consumer's lane i mod n. A pull holds at most half the
   producer's slots (and PULL_SLOTS), so that a consumer that stops reading stalls only itself.
2. `advance` (once the engine progressed the worker) takes back the slots whose sends
   completed and posts what may go next. A layer-wise request's pieces come layer after
   layer (`KVRegion.layer_major_parts`), and a message goes only once every layer it
   carries is written (its `Gate`), the hidden states last.
3. Done when every message was sent and completed.

Lifecycle on the consumer (`ReceiveFlow`, one per lane and pull, on that lane's thread):

1. Built when the pull is asked for, it posts a receive for each of its unpacked pieces
   straight into the destination, and for its packs as slots free up.
2. `advance` copies each completed pack out to its blocks (and waits for that copy, so
   that the slot's next message cannot overwrite it) and posts the next.
3. Done when every receive completed.

Packs are posted in the order the producer sends them, so the oldest pack in flight on
the producer always has a receive or a free slot waiting for it: neither side can stall
the other. After a failure, on either side, `discard_slots` drops the slots still in use,
never to be reused (the worker's `abandon` cancels their receives), and the flow stays, its
buffers with it, until every message it posted has completed (`settled`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from kvwire.connectors.transports.kv_region import Part
from kvwire.connectors.transports.transport import Gate
from kvwire.connectors.transports.ucx.packing import (
    PACK_BELOW,
    Message,
    Staging,
    gather,
    pack_bytes,
    piece_sizes,
    plan_messages,
    scatter,
    wire_buffer,
)

# ucxx only through worker.py, which sets UCX's environment before importing it
from kvwire.connectors.transports.ucx.worker import (
    Array,
    Link,
    Requests,
    UCXWorker,
    all_done,
    check_errors,
    tag_of,
    ucx,
)

PULL_SLOTS = 8  # staging slots one pull's sends may hold at once (and at most half the producer's)
_Pack = tuple[ucx.UCXRequest, Array, Part, Message]  # a posted pack: request, its buffer, the slot, the message


class _Flow:
    """What both sides share: the plan, the unpacked requests, the packs waiting for a slot or in flight."""

    def __init__(self, parts: Sequence[Part], transfer_id: int, pack_below: int, staging: Staging,
                 lane: int = 0, lanes: int = 1, layer_pieces: int = 0):
        self._parts, self._staging = parts, staging
        self._transfer_id, self._packed, self._device_packs = transfer_id, pack_below > 0, pack_below > PACK_BELOW
        plan = plan_messages(piece_sizes(parts), pack_below, layer_pieces)
        assert staging.slot_bytes >= pack_bytes(pack_below) or not any(m.packed for m in plan), "slots too small"
        self._mine = [(i, m) for i, m in enumerate(plan) if i % lanes == lane]
        self._todo: deque[tuple[int, Message]] = deque()  # messages not posted yet, in order
        self._packs: list[_Pack] = []
        self.requests: Requests = []  # unpacked pieces' requests
        self._discarded: Requests = []  # the requests of packs whose slots `discard_slots` dropped
        self.started = time.perf_counter()
        self.packing_s = 0.0  # spent copying packs into or out of slots (and waiting for those copies)

    def summary(self) -> str:
        """Where this flow's time went so far, for a DEBUG line: its messages, and the packing's share."""
        packed = sum(m.packed for _, m in self._mine)
        return (f"{len(self._mine)} messages ({packed} packed), {(time.perf_counter() - self.started) * 1e3:.2f} ms "
                f"since it was built, {self.packing_s * 1e3:.2f} ms of it packing")

    def done(self) -> bool:
        return not self._todo and not self._packs and all_done(self.requests)

    def check_errors(self) -> None:
        check_errors(self.requests)

    def discard_slots(self) -> None:
        """After a failure: the slots in use are never reused; their requests (and buffers) stay for `settled`."""
        for request, buf, slot, _ in self._packs:
            self._staging.discard(slot)
            self._discarded.append((request, buf))
        self._packs, self._todo = [], deque()

    def in_flight(self) -> int:
        """Messages posted and not completed yet."""
        return sum(not req.completed for req, *_ in self._packs) + sum(not req.completed for req, _ in self.requests)

    def settled(self) -> bool:
        """Every message this flow posted has completed (sent, failed or cancelled): UCX touches none of its
        buffers any more. Stops at the first one in flight."""
        return all(req.completed for req, *_ in self._packs) and all_done(self._discarded) and all_done(self.requests)

    def _tag(self, index: int) -> ucx.UCXXTag:
        return ucx.UCXXTag(tag_of(self._transfer_id, index, self._packed, self._device_packs))

    def _reap(self) -> list[_Pack]:
        """The packs whose requests completed (removed from those in flight); raises a failed one's error."""
        done = [p for p in self._packs if p[0].completed]
        for pack in done:
            pack[0].check_error()  # raising, every slot is still in `_packs` for `discard_slots`
        gone = {id(p) for p in done}
        self._packs = [p for p in self._packs if id(p) not in gone]
        return done


class SendFlow(_Flow):
    """A producer's messages of one pull, to every lane of the consumer at `peer`.

    Args:
        gate: a layer-wise request's; its parts then hold `layer_pieces` pieces per layer, layer-major,
            and no pack spans two layers.
        guarded: endpoint error handling on (the consumer is on another host: worker.py).
    Raises:
        ValueError: `peer` is not a well-formed address, or `pack_below` is out of range.
    """

    def __init__(self, transport: UCXWorker, peer: bytes, parts: Sequence[Part], transfer_id: int,
                 pack_below: int, staging: Staging, gate: Gate | None = None, layer_pieces: int = 0,
                 guarded: bool = True):
        super().__init__(parts, transfer_id, pack_below, staging, layer_pieces=layer_pieces)
        self._link = transport.link(peer, guarded)
        self._gate, self._layer_pieces = gate, layer_pieces
        self._share = min(PULL_SLOTS, max(1, staging.max_slots // 2))  # slots this pull may hold at once
        self._todo.extend(self._mine)  # every message goes in order
        self._fill()

    @property
    def link(self) -> Link:
        """The endpoints its messages go through."""
        return self._link

    @property
    def waiting_on_gate(self) -> bool:
        """Nothing in flight, and the next message waits for a layer the forward has not written yet."""
        gate = self._gate
        if gate is None or not self._todo or self._packs or not all_done(self.requests) or gate.needs_polling():
            return False
        if gate.failure:
            return False  # the next `advance` raises it
        _, m = self._todo[0]
        return m.first + m.count > self._sendable()

    def advance(self) -> bool:
        """After the worker was progressed: take back the slots of completed sends, pack the next. Returns
        whether a pack completed. Raises EndpointClosed, unfinished, once its endpoints were closed."""
        if not self.done():
            self._link.check()
        done = self._reap()
        for _, _, slot, _ in done:
            self._staging.give(slot)
        self._fill()
        return bool(done)

    def _sendable(self) -> int:
        """How many pieces, from the first, may go now (all but for a layer-wise request still computing).

        Raises:
            RuntimeError: the request's forward failed; what is not sent never will be.
        """
        gate = self._gate
        if gate is None or gate.complete_and_ready:
            return len(self._parts)
        if gate.failure:
            raise RuntimeError(f"prefill of {gate.request_id} failed: {gate.failure}")
        return self._layer_pieces * gate.ready_layers()

    def _fill(self) -> None:
        limit = self._sendable()
        while self._todo:
            i, m = self._todo[0]
            if m.first + m.count > limit:
                return
            ep = self._link.lane(i)
            if not m.packed:
                buf = Array(wire_buffer(self._parts[m.first]))
                self.requests.append((ep.tag_send(buf, self._tag(i)), buf))
            elif len(self._packs) < self._share and (slot := self._staging.take()) is not None:
                try:
                    start = time.perf_counter()
                    packed = gather(self._parts, m, slot)
                    self.packing_s += time.perf_counter() - start
                    buf = Array(wire_buffer(packed))
                    request = ep.tag_send(buf, self._tag(i))
                except BaseException:
                    self._staging.discard(slot)  # in no pack yet: `discard_slots` would not see it
                    raise
                self._packs.append((request, buf, slot, m))
            else:
                return
            self._todo.popleft()


class ReceiveFlow(_Flow):
    """One consumer lane's receives of one pull from the producer's worker at `peer`.

    Posted through an endpoint to that worker: receives posted on the worker itself cannot
    be cancelled from Python, an endpoint's can (`UCXWorker.abandon`). `layer_pieces`: a
    layer-wise stream's pieces per layer (no pack spans two layers), as the producer has it. `guarded`:
    endpoint error handling on (the producer is on another host: worker.py).
    """

    def __init__(self, transport: UCXWorker, peer: bytes, parts: Sequence[Part], transfer_id: int,
                 pack_below: int, staging: Staging, lane: int = 0, lanes: int = 1, layer_pieces: int = 0,
                 guarded: bool = True):
        super().__init__(parts, transfer_id, pack_below, staging, lane, lanes, layer_pieces)
        self._transport = transport
        self._link = transport.link(peer, guarded)
        for i, m in self._mine:  # every unpacked piece's receive now; packs as slots free up
            if m.packed:
                self._todo.append((i, m))
            else:
                buf = Array(wire_buffer(parts[m.first]))
                self.requests.append((self._link.lane(0).tag_recv(buf, self._tag(i)), buf))
        self._fill()

    def advance(self) -> bool:
        """Progress the worker, unpack the packs that came, post the next. Returns whether anything moved.
        Raises EndpointClosed, unfinished, once its endpoint was closed."""
        moved = self._transport.progress()
        if not self.done():
            self._link.check()
        done = self._reap()
        for k, (_, _, slot, m) in enumerate(done):
            try:
                start = time.perf_counter()
                scatter(slot, self._parts, m)
                self.packing_s += time.perf_counter() - start
            except BaseException:
                for _, _, lost, _ in done[k:]:  # out of `_packs` already: `discard_slots` would not see them
                    self._staging.discard(lost)
                raise
            self._staging.give(slot)
        self._fill()
        return moved or bool(done)

    def _fill(self) -> None:
        while self._todo and (slot := self._staging.take()) is not None:
            i, m = self._todo.popleft()
            try:
                buf = Array(wire_buffer(slot[:m.nbytes]))
                request = self._link.lane(0).tag_recv(buf, self._tag(i))
            except BaseException:
                self._staging.discard(slot)
                raise
            self._packs.append((request, buf, slot, m))
