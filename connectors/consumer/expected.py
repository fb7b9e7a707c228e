"""A consumer's record of one request whose KV it expects: the one place that knows whether it is there.

1. Made by `KVConsumer.expect` (or by a pull of a request nobody announced), with its
   producer and the deadline its KV must be pullable by.
2. Settled once, by whichever source answers first: the producer's KVReady (a
   location), the directory (a READY location, or a terminal state), or the deadline.
   A KVReady that comes after the directory's READY still replaces its location when
   it is the same one with the hidden states inline (a same-host read then needs no round
   trip).
3. Pulled (or failed) by the consumer, which writes its `stats`.

Several threads touch it (the node's engine thread, a directory watcher, the pull thread):
`settle` is guarded, and `stats` is written before the pull's result is handed over.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgspec
import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.wire import KVLocation, TensorDesc
from kvwire.observability.labels import TransferFailure, TransportFallback


@dataclass(frozen=True)
class Received:
    """What one pull moved."""

    hidden: list[torch.Tensor]
    descs: list[TensorDesc]
    intermediate: bool
    kv_bytes: int
    transfer_s: float
    producer: str
    transport: ConnectorKind  # what moved the bytes
    fallback: TransportFallback | None = None  # why not the faster transport it would have taken
    path: str = ""  # what carried the bytes, as the transport tells it ("cma", "cuda_ipc", "sysv/cma", "tcp"...)


@dataclass(eq=False)
class ExpectedKV:
    request_id: str
    producer: str  # the node the router asked to compute it; "" when unknown
    deadline: float  # time.monotonic() by which the KV must be pullable, else the prompt is recomputed
    location: KVLocation | None = None  # once known: where to pull from
    failure: str = ""  # once known: why the KV will never come
    failure_kind: TransferFailure = TransferFailure.PRODUCER
    stats: Received | None = None  # once pulled
    watched: bool = False  # a directory watcher settles it
    producer_epoch: int = 0  # the producer's incarnation the router picked; 0: unknown (not watched for restarts)
    hidden: list[torch.Tensor] | None = None  # the KVReady's hidden states as tensors, made as it came
    _settled: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    def locate(self, location: KVLocation) -> bool:
        """The KV can be pulled from `location`. Returns whether this settled the record (first answer wins)."""
        with self._lock:
            if self._settled.is_set():
                if self.location is not None and location.inline_hidden and \
                        msgspec.structs.replace(location, inline_hidden=b"") == self.location:
                    self.location = location  # the same KV, with its hidden states: still not a settling
                return False
            self.location = location
            self._settled.set()
            return True

    def give_up(self, reason: str, kind: TransferFailure) -> bool:
        """The KV will never come. Returns whether this settled the record (first answer wins)."""
        with self._lock:
            if self._settled.is_set():
                return False
            self.failure, self.failure_kind = reason, kind
            self._settled.set()
            return True

    def pull_failed(self, reason: str, kind: TransferFailure) -> None:
        """The pull from a known location failed: the KV will not come after all (first reason kept)."""
        with self._lock:
            if not self.failure:
                self.failure, self.failure_kind = reason, kind

    def wait(self, timeout_s: float) -> bool:
        """Block until settled or `timeout_s` passes; returns whether it is settled."""
        return self._settled.wait(max(0.0, timeout_s))
