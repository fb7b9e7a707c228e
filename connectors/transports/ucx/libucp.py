"""Calls into the libucp that ucxx loaded, for what ucxx does not do: ctypes on `ucp_ep_h` handles.

The library is looked up by soname and never loaded a second time (RTLD_NOLOAD): these calls act on the very
UCX that ucxx drives. Used for `ucp_ep_query` (query.py) and for closing a failed endpoint (`force_close`):

ucxx 0.52 never closes a guarded endpoint whose peer failed. Its error callback marks the endpoint closing and
returns; its `close_blocking()` (and its destructor) then see it closing and return too, so the UCP endpoint
stays open, failed, with ucxx's `Endpoint` as its error-callback argument, and that object is freed once
Python lets go of it (tests/connectors/transports/ucx/test_endpoint_close.py shows the handle still set after
`close_blocking`). UCX's documented contract is that the user closes a failed endpoint with
`ucp_ep_close_nbx(..., UCP_EP_CLOSE_FLAG_FORCE)`; `force_close` does that. Failed endpoints left open were seen
to break UCX 1.21 later in the same worker: its keepalive round crashed on one, and a producer whose links
to a consumer had been cut and healed died of heap corruption as it made its next TCP endpoint
(`malloc(): unaligned tcache chunk detected` in `uct_tcp_ep_init`, tests/netns).

The structs are UCX 1.21's (ucp/api/ucp.h, ucs/type/status.h): `ucp_request_param_t` begins
`{uint32_t op_attr_mask; uint32_t flags; ...}` and nothing past `flags` is read when only
UCP_OP_ATTR_FIELD_FLAGS is set.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable

UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100
CLOSE_TIMEOUT_S = 2.0  # a forced close is local: it completes within a few progress calls


class LibUCPUnavailable(RuntimeError):
    """The libucp in this process lacks a symbol kvwire calls (or is not loaded)."""


class _RequestParam(ctypes.Structure):
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("_rest", ctypes.c_uint64 * 16)]  # the fields past `flags`, unread here: zeros, room to spare


@functools.cache
def function(name: str, argtypes: tuple, restype: object) -> Callable:
    """`name` from the libucp ucxx loaded. Raises LibUCPUnavailable."""
    try:
        fn = getattr(ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD), name)
    except (OSError, AttributeError) as exc:
        raise LibUCPUnavailable(f"{name} not found: {exc}") from exc
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def force_close(ep_handle: int, progress: Callable[[], object], timeout_s: float = CLOSE_TIMEOUT_S) -> int:
    """Close the UCP endpoint `ep_handle` at once (UCP_EP_CLOSE_FLAG_FORCE: its requests complete cancelled, no
    round trip to the peer), progressing its worker with `progress` until the close completes.

    Returns:
        The close's status (0: closed; 1, UCS_INPROGRESS: not done in `timeout_s`, and the request is
        left to UCX, which completes it as the worker progresses; negative: UCX refused).
    Raises:
        LibUCPUnavailable: libucp lacks the calls.
    """
    close = function("ucp_ep_close_nbx", (ctypes.c_void_p, ctypes.POINTER(_RequestParam)), ctypes.c_void_p)
    check = function("ucp_request_check_status", (ctypes.c_void_p,), ctypes.c_int)
    free = function("ucp_request_free", (ctypes.c_void_p,), None)
    param = _RequestParam(op_attr_mask=UCP_OP_ATTR_FIELD_FLAGS, flags=UCP_EP_CLOSE_FLAG_FORCE)
    request = close(ep_handle, ctypes.byref(param)) or 0
    if request == 0:
        return 0
    if request >= ctypes.c_size_t(UCS_ERR_LAST).value:  # UCS_PTR_IS_ERR: an error status, not a request
        return ctypes.c_ssize_t(request).value
    end = time.monotonic() + timeout_s
    status = check(request)
    while status == UCS_INPROGRESS and time.monotonic() < end:
        progress()
        status = check(request)
    free(request)  # UCX completes (and then releases) a request freed while still in progress
    return status
