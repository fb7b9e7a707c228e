"""Layer-wise KV streaming: ship layer i while layer i + 1 is computed.

Lifecycle: the producer opens a `LayerSender` on a connected stream socket, calls
`layer_done(i)` as each layer's KV is written (vLLM v1's `save_kv_layer` moment); a
sender thread streams that layer's pieces while compute goes on, and `finish()` waits
for the last byte. The consumer's `LayerReceiver.receive_all()` lands each layer
straight into its blocks as it comes and returns once the last layer has landed (the
moment decode can start). Each layer travels as a 16-byte header (magic, layer index,
byte count) and then its raw bytes; a header that does not match what the receiver
expects ends the stream with an error, never a write into the wrong blocks.

This pair is the benchmark's mechanism (`kvwire bench transfer --layerwise`): one
socket, no directory. The nodes stream layer-wise through the TCP connector instead
(`kvwire prefill --connector tcp --layerwise`: connectors/layer_gate.py, the model's
`on_layer` hook, and the TCP send engine's gated sends).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading

import torch

from connectors.kv_region import KVRegion
from connectors.tcp.stream import pump
from connectors.wire import PoolLayout

_HEADER = struct.Struct("<4sIQ")  # magic, layer, nbytes
_MAGIC = b"KVL1"


class LayerStreamError(RuntimeError):
    def __init__(self, peer: str, reason: str):
        super().__init__(f"layer stream with {peer}: {reason}")
        self.peer = peer


def layer_pieces(region: KVRegion, blocks: list[int], layer: int) -> list[torch.Tensor]:
    """Flat uint8 views of one layer's K and V in `blocks`, in block order.

    kvwire's pool: a block's row holds every layer's K and V, so a layer is one contiguous
    slice per block. vLLM's pool: the layer's K plane and V plane, one row per block each.
    """
    layout = region.layout
    if layout.pool == PoolLayout.VLLM:
        return [region.planes[2 * layer + half][b] for half in (0, 1) for b in blocks]
    plane = region.planes[0]
    per_layer = plane.shape[1] // layout.num_layers
    return [plane[b, layer * per_layer:(layer + 1) * per_layer] for b in blocks]


def _nbytes(pieces: list[torch.Tensor]) -> int:
    return sum(p.numel() for p in pieces)


def _move(sock: socket.socket, pieces: list[torch.Tensor], outbound: bool, peer: str, where: str) -> None:
    try:
        pump(sock, pieces, outbound)
    except ConnectionError:
        raise LayerStreamError(peer, f"peer closed the stream {where}") from None


class LayerSender:
    def __init__(self, sock: socket.socket, region: KVRegion, blocks: list[int], peer: str):
        self._sock, self._region, self._blocks, self._peer = sock, region, blocks, peer
        self._todo: queue.Queue[int | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-layer-sender", daemon=True)
        self._thread.start()

    def layer_done(self, layer: int) -> None:
        """Layer `layer`'s KV is in the pool: stream it now, behind whatever is still in flight."""
        self._todo.put(layer)

    def finish(self, timeout_s: float) -> None:
        """Wait until every layer handed over has been sent. Raises LayerStreamError."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise LayerStreamError(self._peer, f"layers not sent within {timeout_s} s")
        if self._error is not None:
            raise LayerStreamError(self._peer, f"send failed: {self._error}") from self._error

    def _run(self) -> None:
        try:
            while (layer := self._todo.get()) is not None:
                pieces = layer_pieces(self._region, self._blocks, layer)
                self._sock.sendall(_HEADER.pack(_MAGIC, layer, _nbytes(pieces)))
                _move(self._sock, pieces, True, self._peer, "mid-layer")
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc


class LayerReceiver:
    def __init__(self, sock: socket.socket, region: KVRegion, blocks: list[int], peer: str):
        self._sock, self._region, self._blocks, self._peer = sock, region, blocks, peer

    def receive_all(self) -> None:
        """Land layers 0..num_layers-1, in order, straight into the blocks. Raises LayerStreamError."""
        for layer in range(self._region.layout.num_layers):
            pieces = layer_pieces(self._region, self._blocks, layer)
            header = self._read_header()
            magic, got, nbytes = _HEADER.unpack(header)
            if magic != _MAGIC or got != layer or nbytes != _nbytes(pieces):
                raise LayerStreamError(self._peer, f"expected layer {layer} of {_nbytes(pieces)} bytes, "
                                                   f"got header {magic!r} layer {got} of {nbytes} bytes")
            _move(self._sock, pieces, False, self._peer, "mid-layer")

    def _read_header(self) -> bytes:
        header = torch.empty(_HEADER.size, dtype=torch.uint8)
        _move(self._sock, [header], False, self._peer, "between layers")
        return header.numpy().tobytes()
