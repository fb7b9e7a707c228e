"""Control messages as they cross a socket: encoded (../wire.py), then sealed (auth.py) when a secret is set.

Every control socket sends `pack(msg)` and reads `unpack(data, expect=...)`; ../wire.py stays
pure data and auth.py knows only bytes.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from kvwire.connectors.control.auth import MAGIC, SEAL_BYTES, seal, unseal
from kvwire.connectors.wire import AnyMessage, PullRequest, WireError, decode, encode

M = TypeVar("M")


def pack(msg: AnyMessage) -> bytes:
    """A control message for another process: encoded, and sealed when an auth secret is installed."""
    return seal(encode(msg))


@overload
def unpack(data: bytes | memoryview, expect: type[M]) -> M: ...
@overload
def unpack(data: bytes | memoryview, expect: tuple[type, ...] | None = None) -> AnyMessage: ...


def unpack(data: bytes | memoryview, expect: type | tuple[type, ...] | None = None) -> Any:
    """A control message from another process: its seal checked (when configured), then decoded.

    Raises:
        WireError: unauthenticated (AuthError), or not a valid message of the expected types.
    """
    return decode(unseal(data), expect=expect)


def peek_request(data: bytes | memoryview) -> PullRequest | None:
    """What a pull request whose seal did not hold says of itself (sealed with another secret, or not at all): only
    to address a refusal to it, never to act on. None when its bytes say nothing readable."""
    view = memoryview(data)
    try:
        return decode(view[SEAL_BYTES:] if bytes(view[:len(MAGIC)]) == MAGIC else view, expect=PullRequest)
    except WireError:
        return None
