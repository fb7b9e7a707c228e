"""One request of this router over its own nodes: the dispatcher's single record of it, from its pick until it is
forgotten.

A record passes:

1. Picked (`Dispatcher.pick` or `submit`): its decode node and its placement `Reservation` (router/placement.py).
2. Submitted (`submit`): a queue for its replies; the watchdog watches its decode node.
3. First reply: its reservation's prefill slot is freed (`prefill` cleared).
4. Last token: its reservation ends (handed to `Placement.ended`, then None).
5. Cancelled (`cancel`): its queue dropped, so `CancelWork` goes once and later replies nowhere. Or failed by the
   watchdog: no longer watched, a `WorkError` put on its queue.
6. Forgotten (`forget`): its record dropped, and its reservation ended if it was still held.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvwire.connectors.wire import NodeInfo
from kvwire.router.placement import Reservation


@dataclass(eq=False)
class InFlight:
    """Owned by the dispatcher's event loop (router/dispatch.py): read and written only there.

    Attributes:
        decode: its decode node as picked: where its work and its cancel go (`work_endpoint`), and the incarnation
            the watchdog looks for (`node_id`, `epoch`).
        reservation: what it holds for placement (router/placement.py): a slot on its prefill node until its first
            reply, its blocks on its decode node until its last token; None once it ended there.
        queue: where its replies go, from `submit` until it is cancelled (None: not submitted, or cancelled).
        watched: the watchdog looks for its decode node, from `submit` until the watchdog failed it.
        missing_since: when the watch first missed its decode node (monotonic); None while the node is there.
    """

    decode: NodeInfo
    reservation: Reservation | None
    queue: asyncio.Queue | None = None
    watched: bool = False
    missing_since: float | None = None
