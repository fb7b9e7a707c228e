"""How far a layer-wise request's prefill has got: what its transfer may send so far.

Lifecycle of a gate:

1. Open: the producer opens a gate for a request before its prefill forward
   (`KVProducer.begin_layers`).
2. Layers done: the forward calls `layer_done(i)` once layer i's K and V are in the pool,
   in order.
3. Complete: `complete()` once the hidden states are in place; or failed: `fail(reason)` if
   the forward stopped.

The transfer server's send engine reads `ready_layers()` / `complete_and_ready` / `failure`
and sends no byte of a layer before that layer is done. Every change calls the waker (the
server's `wake`), so a send that waits for the next layer needs no polling. A CUDA pool's
layer counts as done once the work queued before `layer_done` has run (an event per layer,
queried without blocking): until then `needs_polling()` tells the server loop not to sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class LayerGate:
    def __init__(self, request_id: str, num_layers: int, device: torch.device):
        self.request_id = request_id
        self.num_layers = num_layers
        self._cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._done = 0  # layers whose KV is in the pool (CUDA: whose event has fired)
        self._events: list[torch.cuda.Event] = []  # CUDA: recorded, not yet seen fired, in layer order
        self._marked = 0  # layers the forward has handed over
        self._complete = False
        self._failure: str | None = None
        self._wakers: list[Callable[[], None]] = []

    def add_waker(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakers.append(wake)

    def layer_done(self, layer: int) -> None:
        """Layer `layer`'s KV is written (queued, on a CUDA pool). Layers come in order."""
        with self._lock:
            assert layer == self._marked, f"layer {layer} handed over after {self._marked}"
            self._marked += 1
            if self._cuda:
                event = torch.cuda.Event()
                event.record()
                self._events.append(event)
            else:
                self._done = self._marked
        self._wake()

    def complete(self) -> None:
        """Every layer and the hidden states are in place (queued, on a CUDA pool)."""
        with self._lock:
            assert self._marked == self.num_layers, f"complete after {self._marked} of {self.num_layers} layers"
            if self._cuda:  # the hidden states' copy: one more event after the last layer's
                event = torch.cuda.Event()
                event.record()
                self._events.append(event)
            self._complete = True
        self._wake()

    def fail(self, reason: str) -> None:
        """The forward stopped: what is not sent yet never will be."""
        with self._lock:
            if not self._complete:
                self._failure = reason
        self._wake()

    def ready_layers(self) -> int:
        """Layers that may be sent now."""
        with self._lock:
            while self._events and self._events[0].query():
                self._events.pop(0)
                self._done += 1
            return min(self._done, self.num_layers)

    @property
    def complete_and_ready(self) -> bool:
        """Everything, hidden states included, may be sent."""
        self.ready_layers()
        with self._lock:
            return self._complete and not self._events

    @property
    def failure(self) -> str | None:
        with self._lock:
            return self._failure

    def needs_polling(self) -> bool:
        """True while a CUDA layer was handed over but its event has not been seen fire."""
        with self._lock:
            return bool(self._events)

    def _wake(self) -> None:
        with self._lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()
