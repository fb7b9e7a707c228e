"""A connector half's counts of pulls and of prompts recomputed, kept until vLLM asks (stats.py).

No vLLM import here, so it is tested without vLLM.
"""

from __future__ import annotations

import threading
from typing import Any

from kvwire.connectors.consumer.totals import PullTotals
from kvwire.observability.labels import TransferFailure, TransportFallback


def empty() -> dict[str, Any]:
    """No counts: pulls, their bytes and seconds, failed pulls by TransferFailure, pulls moved over a slower
    transport than they would have taken by TransportFallback, pulls by the path that carried them, control messages
    refused for want of a valid seal."""
    return {"pulls": 0, "pull_bytes": 0, "pull_seconds": [], "failed": {}, "fallbacks": {}, "paths": {}, "rejected": 0}


class Tally:
    """A half's counts since vLLM last asked; any thread may count, vLLM's takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()
        self._totals = PullTotals()  # since the start, for `kvwire status` (the heartbeat)
        self._rejected = 0  # auth rejections already counted

    def totals(self) -> tuple[int, dict[TransferFailure, int]]:
        """Pulls and failed pulls by reason since the start (vLLM's takes do not reset them)."""
        return self._totals.snapshot()

    def pulled(self, nbytes: int, seconds: float, fallback: TransportFallback | None = None, path: str = "") -> None:
        """One pull; `path`: what carried it (Received.path), "" if not known."""
        with self._lock:
            if path:
                self._data["paths"][path] = self._data["paths"].get(path, 0) + 1
            self._totals.pulled()
            self._data["pulls"] += 1
            self._data["pull_bytes"] += nbytes
            self._data["pull_seconds"].append(seconds)
            if fallback is not None:
                fallbacks = self._data["fallbacks"]
                fallbacks[str(fallback)] = fallbacks.get(str(fallback), 0) + 1

    def rejected_so_far(self, total: int) -> None:
        """This process's control messages refused for their seal since it started (auth.rejected_count())."""
        with self._lock:
            self._data["rejected"] += max(0, total - self._rejected)
            self._rejected = max(self._rejected, total)

    def failed(self, reason: TransferFailure) -> None:
        with self._lock:
            self._totals.failed(reason)
            failed = self._data["failed"]
            failed[str(reason)] = failed.get(str(reason), 0) + 1

    def take(self) -> dict[str, Any] | None:
        """The counts since the last take (`KvwireStats.data`), or None if there are none."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if data["pulls"] == 0 and not data["failed"] and not data["rejected"] else data
