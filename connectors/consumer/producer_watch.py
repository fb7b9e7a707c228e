"""A consumer's watch on the producers it waits for: KV a dead producer owed is given up at once.

A prefill node that dies takes with it every request it had been sent but not yet
published: no entry for them will ever turn READY, and without this watch their consumer
would wait out the whole KV deadline before recomputing. Lifecycle:

1. `start()` runs a daemon thread that wakes every WATCH_S while some expected request
   names its producer's epoch (the router's pick, `DecodeWork.prefill_epoch`).
2. Each round reads the registration of every producer waited on (one lookup per producer)
   and gives up every unsettled record whose producer
   - is registered with a higher epoch: it restarted, and the new incarnation never got the work;
   - has not been registered for `absent_grace_s` (its heartbeat TTL): it is dead.
   `on_given_up(request_id)` then fires: the consumer queues it for its owner, which recomputes it.
3. A directory that cannot be read changes nothing: the records keep their deadline.
4. `close()` ends the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvwire.connectors.consumer.expected import ExpectedKV
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory
from kvwire.observability.labels import TransferFailure

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how soon a restarted producer's orphans are given up (a heartbeat is node_ttl_s / 3)


class ProducerWatch:
    """Gives up expected KV whose producer restarted or died.

    Args:
        directory: where producers' registrations are read.
        waiting: the unsettled records to look at (called on the watch thread).
        on_given_up: `(request_id)` after a record was given up here.
        absent_grace_s: a producer missing from the directory this long is dead.
    """

    def __init__(self, directory: KVDirectory, waiting: Callable[[], list[ExpectedKV]],
                 on_given_up: Callable[[str], None], absent_grace_s: float):
        self._directory = directory
        self._waiting = waiting
        self._on_given_up = on_given_up
        self._absent_grace_s = absent_grace_s
        self._missing_since: dict[str, float] = {}  # producer -> when it was first seen unregistered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-producer-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive any one failure
                log.exception("watching producers failed")

    def check(self) -> list[str]:
        """One round (see the module docstring). Returns the ids of the requests given up."""
        records = [r for r in self._waiting() if r.producer_epoch > 0 and not r.settled]
        if not records:
            self._missing_since.clear()
            return []
        verdicts = {p: self._verdict(p) for p in {r.producer for r in records}}
        given_up = []
        for record in records:
            epoch_now = verdicts[record.producer]
            if epoch_now is None or epoch_now == record.producer_epoch:
                continue
            reason = (f"producer {record.producer} is gone (unregistered for {self._absent_grace_s:.0f}s)"
                      if epoch_now < 0 else
                      f"producer {record.producer} restarted (epoch {record.producer_epoch} -> {epoch_now}); "
                      "its earlier incarnation took this request with it")
            if record.give_up(reason, TransferFailure.PRODUCER):
                log.info("request %s: %s; its pull will fail", record.request_id, reason)
                given_up.append(record.request_id)
                self._on_given_up(record.request_id)
        return given_up

    def _verdict(self, producer: str) -> int | None:
        """The producer's registered epoch; -1 once it has been missing for the grace; None: keep waiting."""
        try:
            info = self._directory.get_node(producer)
        except DirectoryError as exc:
            log.debug("cannot read producer %s: %s", producer, exc)
            return None
        now = time.monotonic()
        if info is not None:
            self._missing_since.pop(producer, None)
            return info.epoch
        since = self._missing_since.setdefault(producer, now)
        return -1 if now - since >= self._absent_grace_s else None
