"""A consumer's pulls and failed pulls since its process started: what `kvwire status` shows for it.

Its node's heartbeat publishes them (`NodeInfo.pulls`, `NodeInfo.recomputed`); the metrics count the
same events (`kvwire_kv_transfers_failed_total`) for Prometheus. Any thread counts; readers take a copy.
"""

from __future__ import annotations

import threading

from kvwire.observability.labels import TransferFailure


class PullTotals:
    """Pulls that moved a request's KV, and pulls that failed (the prompt recomputed), by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pulls = 0
        self._failed: dict[TransferFailure, int] = {}

    def pulled(self) -> None:
        with self._lock:
            self._pulls += 1

    def failed(self, reason: TransferFailure) -> None:
        with self._lock:
            self._failed[reason] = self._failed.get(reason, 0) + 1

    def snapshot(self) -> tuple[int, dict[TransferFailure, int]]:
        """(pulls, failed pulls by reason) so far."""
        with self._lock:
            return self._pulls, dict(self._failed)
