"""One UCX context and worker per process, in blocking-progress mode.

Endpoints are made from the peer's *worker address* with endpoint error handling
off: that is what lets UCX pick shared memory and cross-memory attach between two
processes on one host (listener endpoints, or error handling on, fall back to
loopback TCP). The price is that UCX does not notice a dead peer, so every wait
here has a deadline and the directory's TTLs clean up after it.

Not thread-safe: one thread owns a transport (the producer's server thread, or the
consumer's engine thread).
"""

from __future__ import annotations

import os

import torch

# ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and warns about at every start.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

SEGMENT_BITS = 24  # low tag bits: piece index within one transfer
MAX_PIECES = 1 << SEGMENT_BITS


def _config() -> dict[str, str]:
    """UCX settings kvwire picks unless the environment sets them (UCX_<NAME> wins)."""
    # The sender pushes each piece once the receiver's buffer is known. Over TCP this ran 2.5-3.3 GB/s
    # against 0.9 for UCX's default (the receiver pulling fragments); over CMA both ran alike.
    ours = {"RNDV_SCHEME": "put_zcopy"}
    return {k: v for k, v in ours.items() if f"UCX_{k}" not in os.environ}


def tag_for(transfer_id: int, piece: int) -> ucx.UCXXTag:
    return ucx.UCXXTag((transfer_id << SEGMENT_BITS) | piece)


def as_array(t: torch.Tensor) -> Array:
    """A contiguous tensor as a UCX buffer: host memory via numpy, CUDA via __cuda_array_interface__."""
    flat = t if t.dtype == torch.uint8 and t.dim() == 1 else t.reshape(-1).view(torch.uint8)  # pieces already are
    return Array(flat.numpy() if flat.device.type == "cpu" else flat)


class UCXTransport:
    def __init__(self) -> None:
        self._ctx = ucx.UCXContext(config_dict=_config(), feature_flags=(ucx.Feature.TAG,))
        self._worker = ucx.UCXWorker(self._ctx)
        self._endpoints: dict[bytes, ucx.UCXEndpoint] = {}
        self.address: bytes = self._worker.address.tobytes()

    @property
    def event_fd(self) -> int:
        """Readable when the worker has events; wait on it after `arm()` returns True."""
        return self._worker.epoll_file_descriptor

    def progress(self) -> None:
        self._worker.progress()

    def arm(self) -> bool:
        """True when it is safe to block on `event_fd`; False means progress again first."""
        return self._worker.arm()

    def post_sends(self, peer: bytes, pieces: list[torch.Tensor], transfer_id: int) -> list[tuple[object, Array]]:
        """Start one tagged send per piece to the worker at `peer`. Keep the result alive until done."""
        ep = self._endpoint(peer)
        out = []
        for i, piece in enumerate(pieces):
            buf = as_array(piece)
            out.append((ep.tag_send(buf, tag_for(transfer_id, i)), buf))
        return out

    def post_recvs(self, pieces: list[torch.Tensor], transfer_id: int) -> list[tuple[object, Array]]:
        """Post one tagged receive per piece, straight into the destination memory."""
        out = []
        for i, piece in enumerate(pieces):
            buf = as_array(piece)
            out.append((self._worker.tag_recv(buf, tag_for(transfer_id, i)), buf))
        return out

    def cancel_all(self) -> int:
        """Cancel every request in flight on this worker (after a deadline passed)."""
        return self._worker.cancel_inflight_requests()

    def forget_peer(self, peer: bytes) -> None:
        ep = self._endpoints.pop(peer, None)
        if ep is not None:
            ep.close()

    def close(self) -> None:
        for peer in list(self._endpoints):
            self.forget_peer(peer)

    def _endpoint(self, peer: bytes) -> ucx.UCXEndpoint:
        ep = self._endpoints.get(peer)
        if ep is None:
            addr = ucx.UCXAddress.create_from_buffer(peer)
            ep = ucx.UCXEndpoint.create_from_worker_address(self._worker, addr, False)
            self._endpoints[peer] = ep
        return ep


def all_done(requests: list[tuple[object, Array]]) -> bool:
    return all(req.completed for req, _ in requests)


def check_errors(requests: list[tuple[object, Array]]) -> None:
    """Raise the first UCX error among completed requests."""
    for req, _ in requests:
        req.check_error()
