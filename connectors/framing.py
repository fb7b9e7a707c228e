"""Control messages as they cross a socket: encoded (wire.py), then sealed (auth.py) when a secret is set.

Every control socket sends `pack(msg)` and reads `unpack(data, expect=...)`; wire.py stays
pure data and auth.py knows only bytes.
"""

from __future__ import annotations

from kvwire.connectors.auth import seal, unseal
from kvwire.connectors.wire import Message, decode, encode


def pack(msg: Message) -> bytes:
    """A control message for another process: encoded, and sealed when an auth secret is installed."""
    return seal(encode(msg))


def unpack(data: bytes | memoryview, expect: type | tuple[type, ...] | None = None) -> Message:
    """A control message from another process: its seal checked (when configured), then decoded.

    Raises:
        WireError: unauthenticated (AuthError), or not a valid message of the expected types.
    """
    return decode(unseal(data), expect=expect)
