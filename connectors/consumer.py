"""Consumer role, transport-agnostic: find a request's KV in the directory and pull it.

For each request of a prompt batch: wait (bounded) for its directory entry to be
READY, check the producer's layout matches ours, let the transport pull the blocks
and hidden states. The producer, having confirmed the pull, marks the entry CONSUMED
and deletes it (producer.py): no directory write on the way to the first token. Any
failure here marks the entry FAILED (so a late producer releases its blocks at once)
and raises TransferError; the caller recomputes. Bytes and time of each pull, and each failure
by reason, go to the process's metrics.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorConfig, ConnectorKind
from kvwire.connectors.directory import DirectoryEntry, DirectoryError, KVDirectory, TransferState
from kvwire.connectors.hidden import empty_like_descs
from kvwire.connectors.kv_checksum import layer_checksums
from kvwire.connectors.kv_region import KVRegion
from kvwire.connectors.offers import narrow
from kvwire.connectors.wire import KVLocation, TensorDesc
from kvwire.engine.model_input import SequenceInput
from kvwire.observability.labels import TransferFailure
from kvwire.observability.metrics import Metrics, process_metrics

log = logging.getLogger(__name__)


class Puller(Protocol):
    """A transport's consumer half. One that picks among transports per pull (auto) also
    sets `last_transport` to the kind it used."""

    transport_address: bytes  # published in the directory; producers send only there

    def pull(self, loc: KVLocation, dst_blocks: list[int], hidden: list[torch.Tensor], deadline: float) -> int: ...
    def close(self) -> None: ...


class ReceiveError(TransferError):
    """A TransferError the receiver itself found, with its kind for kvwire_kv_transfers_failed_total."""

    def __init__(self, request_id: str, peer: str, reason: str, failure: TransferFailure):
        super().__init__(request_id, peer, reason)
        self.failure = failure


def _failure(exc: Exception) -> TransferFailure:
    if isinstance(exc, ReceiveError):
        return exc.failure
    return TransferFailure.DIRECTORY if isinstance(exc, DirectoryError) else TransferFailure.TRANSPORT


@dataclass(frozen=True)
class Received:
    hidden: list[torch.Tensor]
    descs: list[TensorDesc]
    intermediate: bool
    kv_bytes: int
    transfer_s: float
    producer: str
    transport: str  # the connector kind that moved the bytes


class KVConsumer:
    def __init__(self, config: ConnectorConfig, directory: KVDirectory, region: KVRegion,
                 puller: Puller, device: torch.device | str, metrics: Metrics | None = None):
        self._config = config
        self._metrics = metrics or process_metrics()
        self._directory = directory
        self._region = region
        self._layout = region.layout
        self._puller = puller
        self._device = device

    def receive(self, seq: SequenceInput, deadline: float, ready: DirectoryEntry | None = None) -> Received:
        """Pull one request's KV into `seq.block_ids`, starting from `ready` (its READY entry) when the
        caller has it. Raises TransferError."""
        try:
            return self._receive(seq, deadline, ready)
        except (TransferError, DirectoryError) as exc:
            self._metrics.kv_transfers_failed.labels(str(_failure(exc))).inc()
            self._mark_failed(seq.request_id, str(exc))
            if isinstance(exc, TransferError):
                raise
            raise TransferError(seq.request_id, "directory", str(exc)) from exc

    def _receive(self, seq: SequenceInput, deadline: float, ready: DirectoryEntry | None) -> Received:
        rid = seq.request_id
        entry = ready or self._directory.wait_for(rid, {TransferState.READY}, deadline)
        if entry is None:
            raise ReceiveError(rid, "unknown producer", "KV not ready before the deadline", TransferFailure.DEADLINE)
        if entry.state != TransferState.READY or entry.location is None:
            raise ReceiveError(rid, entry.producer, f"entry is {entry.state}: {entry.reason}", TransferFailure.PRODUCER)
        loc = entry.location
        self._check(seq, loc)
        if self._config.kind != ConnectorKind.AUTO:  # an auto puller picks per pull itself
            loc = narrow(loc, [self._config.kind])
        n_blocks = len(loc.block_ids)
        hidden = empty_like_descs(loc.hidden, self._device)
        start = time.monotonic()
        nbytes = self._puller.pull(loc, list(seq.block_ids[:n_blocks]), hidden, deadline)
        elapsed = time.monotonic() - start
        transport = str(getattr(self._puller, "last_transport", loc.kind))
        self._verify(seq, loc)
        self._metrics.observe_transfer(transport, nbytes, elapsed)  # the producer marks the entry CONSUMED
        log.info("request %s: %d bytes from %s over %s in %.2f ms", rid, nbytes, loc.producer, transport, elapsed * 1e3)
        return Received(hidden, loc.hidden, loc.intermediate, nbytes, elapsed, loc.producer, transport)

    def _verify(self, seq: SequenceInput, loc: KVLocation) -> None:
        """--verify-kv: the blocks we hold now must match the producer's per-layer checksums."""
        if not self._config.verify_kv:
            return
        def bad(reason: str) -> TransferError:
            return ReceiveError(seq.request_id, loc.producer, reason, TransferFailure.TRANSPORT)

        if not loc.layer_checksums:
            raise bad("producer published no KV checksums (run it with --verify-kv too)")
        got = layer_checksums(self._region, list(seq.block_ids[:len(loc.block_ids)]))
        if got != loc.layer_checksums:
            wrong = [i for i, (a, b) in enumerate(zip(got, loc.layer_checksums)) if a != b]
            raise bad(f"KV checksum mismatch in layers {wrong}")

    def _check(self, seq: SequenceInput, loc: KVLocation) -> None:
        def bad(reason: str) -> TransferError:
            return ReceiveError(seq.request_id, loc.producer, reason, TransferFailure.MISMATCH)

        if loc.layout != self._layout:
            raise bad(f"producer layout {loc.layout} does not match ours {self._layout}")
        if seq.start_pos != 0 or loc.num_tokens != seq.num_tokens:
            raise bad(f"producer has {loc.num_tokens} prompt tokens, we need {seq.num_tokens}")
        n_blocks = math.ceil(loc.num_tokens / self._layout.block_size)
        if len(loc.block_ids) != n_blocks or len(seq.block_ids) < n_blocks:
            raise bad(f"block count mismatch: producer {len(loc.block_ids)}, needed {n_blocks}, ours {len(seq.block_ids)}")
        if any(d.shape[:1] != (seq.num_tokens,) for d in loc.hidden):
            raise bad("hidden states do not cover the prompt")

    def _mark_failed(self, request_id: str, reason: str) -> None:
        log.warning("request %s: transfer failed, recomputing: %s", request_id, reason)
        try:
            self._directory.create_pending(request_id, producer="unknown")
            self._directory.transition(request_id, {TransferState.PENDING, TransferState.READY},
                                       TransferState.FAILED, reason[:500])
        except DirectoryError as exc:
            log.warning("request %s: cannot mark failed: %s", request_id, exc)
