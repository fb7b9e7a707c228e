"""The few UCP calls ucxx's Python layer lacks: one-sided RMA (memory registration, remote keys, get).

ucxx owns the context, worker and endpoints; it hands out their raw UCP handles
(`.handle`), and this module calls UCP's C API on them through ctypes, on the same
libucp that ucxx loaded. Every call here is made by the one thread that owns the
worker (see transport.py).

Lifecycle: `Registration` maps one region once (`ucp_mem_map`) and packs its remote
key, the bytes a peer needs to read it; a peer unpacks them into a `RemoteKey` on an
endpoint to that region's owner, then `get` issues non-blocking reads (their requests
freed at once: completion is observed through `flush`, one request per batch), and
`wait` polls the worker until that flush completes. Nothing here allocates per piece
beyond UCP's own requests.
"""

from __future__ import annotations

import ctypes
import functools
import os

_UCS_ERR_LAST = -100  # ucs_status_t errors are -1 .. -99; a status pointer in that range is an error
_UCS_INPROGRESS = 1
_MEM_MAP_ADDRESS_AND_LENGTH = 0b11  # UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH


class UCPError(RuntimeError):
    """A UCP call returned an error status."""

    def __init__(self, call: str, status: int):
        super().__init__(f"{call} failed: UCS status {status}")
        self.status = status


class _MemMapParams(ctypes.Structure):
    # ucp_mem_map_params_t up to the fields we set; the rest is ignored because field_mask leaves it out
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("length", ctypes.c_size_t),
                ("_unused", ctypes.c_uint8 * 64)]


# ucp_request_param_t with op_attr_mask = 0: UCP reads nothing else, so zeroed bytes of ample size do
_NO_PARAMS = (ctypes.c_uint8 * 256)()


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_loaded_libucp())
    sig = {
        "ucp_mem_map": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_MemMapParams), ctypes.POINTER(ctypes.c_void_p)]),
        "ucp_mem_unmap": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
        "ucp_rkey_pack": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_size_t)]),
        "ucp_rkey_buffer_release": (None, [ctypes.c_void_p]),
        "ucp_ep_rkey_unpack": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]),
        "ucp_rkey_destroy": (None, [ctypes.c_void_p]),
        "ucp_get_nbx": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64,
                                          ctypes.c_void_p, ctypes.c_void_p]),
        "ucp_ep_flush_nbx": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p]),
        "ucp_request_check_status": (ctypes.c_int, [ctypes.c_void_p]),
        "ucp_request_free": (None, [ctypes.c_void_p]),
        "ucp_worker_progress": (ctypes.c_uint, [ctypes.c_void_p]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _loaded_libucp() -> str:
    """The path of the libucp this process already loaded (through ucxx): one UCP, not two."""
    import ucxx._lib.libucxx  # noqa: F401 - loads libucp

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if os.path.basename(path).startswith("libucp.so"):
                return path
    return "libucp.so.0"


def _status_of(ptr: int | None) -> int:
    """UCS_PTR_STATUS: 0 for NULL (done at once), the error for an error pointer, else in progress."""
    if not ptr:
        return 0
    signed = ctypes.c_int64(ptr).value
    return signed if _UCS_ERR_LAST < signed < 0 else _UCS_INPROGRESS


def _check(call: str, status: int) -> None:
    if status != 0:
        raise UCPError(call, status)


class Registration:
    """One region of this process's memory mapped for remote access, and its packed remote key."""

    def __init__(self, context: int, address: int, nbytes: int):
        self._context = context
        params = _MemMapParams(field_mask=_MEM_MAP_ADDRESS_AND_LENGTH, address=address, length=nbytes)
        memh = ctypes.c_void_p()
        _check("ucp_mem_map", _lib().ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh)))
        self._memh = memh
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        status = _lib().ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size))
        if status != 0:
            self.close()
            raise UCPError("ucp_rkey_pack", status)
        self.rkey = ctypes.string_at(buf, size.value)
        _lib().ucp_rkey_buffer_release(buf)

    def close(self) -> None:
        if self._memh:
            _lib().ucp_mem_unmap(self._context, self._memh)
            self._memh = ctypes.c_void_p()


class RemoteKey:
    """A peer's packed remote key, unpacked on my endpoint to that peer (valid while the endpoint lives)."""

    def __init__(self, endpoint: int, packed: bytes):
        handle = ctypes.c_void_p()
        _check("ucp_ep_rkey_unpack", _lib().ucp_ep_rkey_unpack(endpoint, packed, ctypes.byref(handle)))
        self.handle = handle.value

    def close(self) -> None:
        if self.handle:
            _lib().ucp_rkey_destroy(self.handle)
            self.handle = None


def get(endpoint: int, reads: list[tuple[int, int, int, int]]) -> None:
    """Start one-sided reads `(local_address, nbytes, remote_address, rkey_handle)` on `endpoint`.

    Requests are released at once; `flush` then tells when all of them completed.
    Raises:
        UCPError: UCP refused a read (those started before it still run; flush or close the endpoint).
    """
    lib = _lib()
    get_nbx, free = lib.ucp_get_nbx, lib.ucp_request_free
    for local, nbytes, remote, rkey in reads:
        req = get_nbx(endpoint, local, nbytes, remote, rkey, _NO_PARAMS)
        status = _status_of(req)
        if status == _UCS_INPROGRESS:
            free(req)
        elif status != 0:
            raise UCPError("ucp_get_nbx", status)


def flush(endpoint: int) -> int | None:
    """Start flushing `endpoint`: its request, or None when everything already completed."""
    req = _lib().ucp_ep_flush_nbx(endpoint, _NO_PARAMS)
    status = _status_of(req)
    if status == _UCS_INPROGRESS:
        return req
    _check("ucp_ep_flush_nbx", status)
    return None


def done(request: int | None) -> bool:
    """Whether a flush request completed (raises its error); a completed request is freed."""
    if request is None:
        return True
    status = _lib().ucp_request_check_status(request)
    if status == _UCS_INPROGRESS:
        return False
    _lib().ucp_request_free(request)
    _check("flush", status)
    return True


def release(request: int | None) -> None:
    """Give up on an unfinished flush request (the endpoint is being closed)."""
    if request is not None:
        _lib().ucp_request_free(request)


def progress(worker: int) -> int:
    return _lib().ucp_worker_progress(worker)
