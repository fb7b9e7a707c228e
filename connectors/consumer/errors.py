"""Why a consumer's pull failed: its own findings as `ReceiveError`, any failure as a `TransferFailure` kind."""

from __future__ import annotations

from kvwire.connectors.base import TransferError
from kvwire.connectors.directory.directory import DirectoryError
from kvwire.observability.labels import TransferFailure


class ReceiveError(TransferError):
    """A TransferError the consumer itself found, with its kind for kvwire_kv_transfers_failed_total."""

    def __init__(self, request_id: str, peer: str, reason: str, failure: TransferFailure):
        super().__init__(request_id, peer, reason)
        self.failure = failure


def failure_of(exc: Exception) -> TransferFailure:
    """Why a pull failed, for kvwire_kv_transfers_failed_total (and vLLM's counterpart: connectors/vllm/stats.py)."""
    if isinstance(exc, ReceiveError):
        return exc.failure
    return TransferFailure.DIRECTORY if isinstance(exc, DirectoryError) else TransferFailure.TRANSPORT
