"""Many requests' directory steps in one Redis round trip (a pipeline, not a transaction).

Each queued step runs the same compare-and-set script `KVDirectory` runs for one
request, so the state machine and its checks are unchanged; only the round trips are
shared. Used where a node handles many requests at once, and by `kvwire bench directory`.

Scripts are queued as plain EVALSHA: redis-py's own pipelined scripts cost an extra
SCRIPT EXISTS round trip on every execute, the very cost a batch exists to save
(docs/BENCHMARKS.md). A server that does not know a script (restarted, flushed) answers
NOSCRIPT for that step alone; such steps are re-run one by one with the script loaded,
after the rest of the batch (so a read queued after such a step saw the state before it;
KVDirectory loads the scripts when it starts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.connection import _ms
from kvwire.connectors.directory.directory import DirectoryEntry, DirectoryError, KVDirectory, TransferState
from kvwire.connectors.wire import KVLocation, encode

StepResult = bool | DirectoryEntry | None
_Parse = Callable[[Any], StepResult]  # a step's raw reply (as redis-py parsed it) -> its result
_IGNORED: tuple[_Parse, None] = (lambda reply: None, None)


class DirectoryBatch:
    def __init__(self, directory: KVDirectory):
        self._dir = directory
        self._pipe = directory._redis.pipeline(transaction=False)
        # one per queued reply: (raw reply -> result, re-run the step alone on NOSCRIPT: scripts only)
        self._steps: list[tuple[_Parse, Callable[[], object] | None]] = []

    def _script(self, script: Script, keys: list[str], args: list[EncodableT], parse: _Parse) -> None:
        self._pipe.evalsha(script.sha, len(keys), *keys, *args)
        self._steps.append((parse, lambda: script(keys=keys, args=args)))  # a plain call loads the script

    def publish_ready(self, location: KVLocation) -> DirectoryBatch:
        d, rid = self._dir, location.request_id
        self._script(d._publish, keys=[*d._entry_keys(rid), d._node_keys(location.producer)[1]],
                     args=[location.producer, encode(location), _ms(d.entry_ttl_s), location.producer_epoch],
                     parse=lambda r: r == 1)  # -1: fenced (stale epoch), 0: not PENDING
        return self

    def get(self, request_id: str) -> DirectoryBatch:
        self._pipe.hgetall(self._dir._entry_keys(request_id)[0])
        self._steps.append((lambda fields: self._dir._parse_entry(request_id, fields), None))
        return self

    def transition(self, request_id: str, allowed_from: Iterable[TransferState], to: TransferState,
                   reason: str = "") -> DirectoryBatch:  # fmt: skip
        d, sources = self._dir, sorted({TransferState(s) for s in allowed_from})
        self._script(d._transition, keys=d._entry_keys(request_id), args=[to, _ms(d.entry_ttl_s), reason, *sources],
                     parse=bool)
        return self

    def delete(self, request_id: str) -> DirectoryBatch:
        self._pipe.delete(*self._dir._entry_keys(request_id))
        self._steps.append(_IGNORED)
        return self

    def record_transfer(self, node_id: str, transport: ConnectorKind, nbytes: int) -> DirectoryBatch:
        self._dir.queue_record_transfer(self._pipe, node_id, transport, nbytes)
        self._steps += [_IGNORED] * 3
        return self

    def execute(self) -> list[StepResult]:
        """Send every queued step; their results in order. Raises DirectoryError."""
        steps, self._steps = self._steps, []
        with self._dir._errors("batch"):
            raw = self._pipe.execute(raise_on_error=False)
            raw = [retry() if isinstance(r, NoScriptError) and retry else r for r, (_, retry) in zip(raw, steps)]
        for reply in raw:
            if isinstance(reply, Exception):
                raise DirectoryError(f"batch step failed: {reply}", peer=self._dir.peer)
        return [parse(r) for (parse, _), r in zip(steps, raw)]
