"""One request on a decode node: the node's single record of it, from its `DecodeWork` to its last token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.observability.tracing import TraceContext
from kvwire.protocol.work import DecodeWork


@dataclass(eq=False)
class DecodeRequest:
    """Owned by the node's engine thread (decode_node/server.py).

    Attributes:
        work: the request as the router sent it: prompt, sampling, its producer (`prefill_node`, "" for
            none: computed here) and the router's reply endpoint (`reply_to`).
        kv: its consumer's record: deadline, location once known, stats once pulled (thread-safe itself);
            None when no producer computes the prompt.
        trace: the client's trace context, checked (observability/tracing.py); None: none came.
        arrived_ns: when the work was taken (time.time_ns()), where its span starts.

    Its state is the queue it sits in: the node's `awaiting_kv` (its KV's location or verdict not known yet),
    then the engine's waiting, receiving (its KV being pulled) and running queues.
    """

    work: DecodeWork
    kv: ExpectedKV | None = None
    trace: TraceContext | None = None
    arrived_ns: int = field(default_factory=time.time_ns)

    @property
    def request_id(self) -> str:
        return self.work.request_id
