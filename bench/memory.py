"""Peak memory a process uses beyond what it held when measuring started (Linux /proc).

`PeakTracker.start()` resets the kernel's high-water mark of resident memory
(clear_refs 5) and notes the current figures; `extra_bytes()` is the high-water mark
since then minus that baseline, not counting shared-memory pages newly mapped (a
producer's pool mapped by a shm consumer is the pool, not extra memory).
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(*fields: str) -> dict[str, int]:
    out = {}
    for line in _STATUS.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            out[name] = int(rest.split()[0])
    return out


class PeakTracker:
    def __init__(self) -> None:
        self._rss = self._shmem = 0

    def start(self) -> PeakTracker:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        now = _status_kib("VmRSS", "RssShmem")
        self._rss, self._shmem = now["VmRSS"], now["RssShmem"]
        return self

    def extra_bytes(self) -> int:
        now = _status_kib("VmHWM", "RssShmem")
        return max(0, (now["VmHWM"] - self._rss) - (now["RssShmem"] - self._shmem)) * 1024
