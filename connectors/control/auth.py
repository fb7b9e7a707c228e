"""Authentication of control messages between kvwire processes (HMAC-SHA256 over a shared secret).

1. A process's entry point calls `install(secret)` once, from its frozen config, before it
   opens any socket (None, the default and what a single host needs: messages travel as
   they are).
2. From then on every control message it sends is sealed (framing.py `pack`), and every
   one it receives must carry a valid seal (`unpack`), else it is refused and counted.

A sealed message is `MAGIC | timestamp (8 bytes, ns) | HMAC-SHA256(secret, MAGIC |
timestamp | payload) | payload`. Receivers check the tag in constant time and refuse a
timestamp more than `MAX_SKEW_S` away from their clock, which bounds replay. What is
protected: the router's work messages to nodes, token streams back, pull requests and
replies on the transfer side channels, and the shm hand-off. What is not: the KV bytes
themselves on UCX / NCCL / TCP data connections (see the README's security section).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import time
from pathlib import Path

from kvwire.connectors.wire import WireError
from kvwire.observability.labels import RejectReason
from kvwire.observability.metrics import process_metrics

MAGIC = b"KVA1"
MAX_SKEW_S = 300.0
MIN_SECRET_BYTES = 16
_TS = struct.Struct("<q")
_TAG_BYTES = 32
_HEADER = len(MAGIC) + _TS.size + _TAG_BYTES
SEAL_BYTES = _HEADER  # what sealing adds to a message

_secret: bytes | None = None
_rejected = 0
_lock = threading.Lock()


class AuthError(WireError):
    """A control message without a valid seal (or with one where none was expected)."""


def read_secret_file(path: Path) -> bytes:
    """The secret in `path`, surrounding whitespace stripped. Raises ValueError if too short or unreadable."""
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the auth secret file {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the auth secret in {path} has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret


def install(secret: bytes | None) -> None:
    """Seal and check every control message of this process with `secret` (None: no authentication)."""
    global _secret
    _secret = secret


def rejected_count() -> int:
    """Messages refused for a missing or wrong seal since the process started."""
    return _rejected


def seal(payload: bytes) -> bytes:
    if _secret is None:
        return payload
    head = MAGIC + _TS.pack(time.time_ns())
    return head + hmac.digest(_secret, head + payload, hashlib.sha256) + payload


def unseal(data: bytes | memoryview) -> bytes | memoryview:
    """The payload of a sealed message. Raises AuthError (counted) if the seal is missing or wrong, or if the message
    is sealed and this process has no secret (an envelope never starts with MAGIC: it is a msgpack array)."""
    if _secret is None:
        if bytes(data[:len(MAGIC)]) == MAGIC:
            _reject("message is sealed, and this process has no auth secret (configure the same secret on both)")
        return data
    view = memoryview(data)
    if len(view) < _HEADER or view[:len(MAGIC)] != MAGIC:
        _reject("message is not sealed (is the peer configured with the auth secret?)")
    head, tag, payload = view[:len(MAGIC) + _TS.size], view[len(MAGIC) + _TS.size:_HEADER], view[_HEADER:]
    want = hmac.new(_secret, head, hashlib.sha256)
    want.update(payload)
    if not hmac.compare_digest(want.digest(), bytes(tag)):
        _reject("bad seal (wrong secret, or the message was altered)")
    skew = abs(time.time_ns() - _TS.unpack(head[len(MAGIC):])[0]) / 1e9
    if skew > MAX_SKEW_S:
        _reject(f"seal is {skew:.0f} s old or ahead (replayed, or clocks differ by more than {MAX_SKEW_S:.0f} s)")
    return payload


def _reject(reason: str) -> None:
    global _rejected
    with _lock:
        _rejected += 1
    process_metrics().messages_rejected.labels(str(RejectReason.UNAUTHENTICATED)).inc()
    raise AuthError(reason)
