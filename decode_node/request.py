"""One request on a decode node: the node's single record of it, from its `DecodeWork` to its last token."""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.protocol.work import DecodeWork


@dataclass(eq=False)
class DecodeRequest:
    """Owned by the node's engine thread (decode_node/server.py).

    Attributes:
        work: the request as the router sent it: prompt, sampling, its producer (`prefill_node`, "" for
            none: computed here) and the router's reply endpoint (`reply_to`).
        kv: its consumer's record: deadline, location once known, stats once pulled (thread-safe itself);
            None when no producer computes the prompt.

    Its state is the queue it sits in: the node's `awaiting_kv` (its KV's location or verdict not known yet),
    then the engine's waiting, receiving (its KV being pulled) and running queues.
    """

    work: DecodeWork
    kv: ExpectedKV | None = None

    @property
    def request_id(self) -> str:
        return self.work.request_id
