"""What UCX selected for an endpoint: its transports (sysv, posix, cma, tcp, rc_mlx5, ...).

ucxx does not wrap `ucp_ep_query`, so it is called through ctypes on the libucp that ucxx
already loaded (libucp.py); an endpoint's `handle` is its `ucp_ep_h`. The structs below are
UCX 1.21's, from ucp/api/ucp.h and ucp_def.h:

    ucp_ep_attr_t        { uint64_t field_mask; char name[UCP_ENTITY_NAME_MAX = 32];
                           struct sockaddr_storage local_sockaddr, remote_sockaddr;
                           ucp_transports_t transports; void *user_data; }
    ucp_transports_t     { ucp_transport_entry_t *entries; unsigned num_entries; size_t entry_size; }
    ucp_transport_entry_t { const char *transport_name; const char *device_name; }

Only `transports` is asked for (UCP_EP_ATTR_FIELD_TRANSPORTS); UCX fills at most
`num_entries` entries of `entry_size` bytes and writes back how many lanes it has. Whatever
goes wrong (no libucp symbol, an error status) raises `QueryUnavailable`: callers report the
path as unknown, with the reason, and never fail a transfer over it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from kvwire.connectors.transports.ucx.libucp import LibUCPUnavailable, function

UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
MAX_ENTRIES = 16  # lanes an endpoint may have (UCP_MAX_LANES is 8 in UCX 1.21)


class QueryUnavailable(RuntimeError):
    """UCX could not say which transports an endpoint uses."""


class _Entry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [("entries", ctypes.POINTER(_Entry)), ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32),
                ("local_sockaddr", ctypes.c_uint64 * 16), ("remote_sockaddr", ctypes.c_uint64 * 16),  # 128 B each
                ("transports", _Transports), ("user_data", ctypes.c_void_p)]


def _ep_query() -> Callable[[int, object], int]:
    """`ucp_ep_query` of the libucp in this process. Raises QueryUnavailable."""
    try:
        return function("ucp_ep_query", (ctypes.c_void_p, ctypes.POINTER(_EpAttr)), ctypes.c_int)
    except LibUCPUnavailable as exc:
        raise QueryUnavailable(str(exc)) from exc


def endpoint_transports(ep_handle: int) -> list[tuple[str, str]]:
    """(transport, device) per lane of the UCX endpoint `ep_handle`, e.g. [("sysv", "memory"), ("cma", "memory")].

    Raises:
        QueryUnavailable: libucp has no ucp_ep_query, or it failed for this endpoint.
    """
    if not ep_handle:
        raise QueryUnavailable("endpoint has no handle")
    entries = (_Entry * MAX_ENTRIES)()
    attr = _EpAttr(field_mask=UCP_EP_ATTR_FIELD_TRANSPORTS)
    attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(_Entry))
    attr.transports.num_entries = MAX_ENTRIES
    attr.transports.entry_size = ctypes.sizeof(_Entry)
    status = _ep_query()(ep_handle, ctypes.byref(attr))
    if status != 0:
        raise QueryUnavailable(f"ucp_ep_query returned status {status}")
    n = min(attr.transports.num_entries, MAX_ENTRIES)
    return [((e.transport_name or b"?").decode(), (e.device_name or b"?").decode()) for e in entries[:n]]
