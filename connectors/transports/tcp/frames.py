"""The TCP data connection's fixed frames, its address format, and socket tuning.

Frames are fixed-size structs (see the package docstring); nothing a peer sends is
ever interpreted as anything but these three layouts and raw tensor bytes.
"""

from __future__ import annotations

import os
import socket
import struct

HELLO_MAGIC = b"kvwHELO1"
ACK = b"kvwACK01"
DATA_MAGIC = b"kvwDATA1"
TOKEN_BYTES = 16
HELLO = struct.Struct(f"!8s{TOKEN_BYTES}s")  # magic, consumer token
HEADER = struct.Struct("!8sQQ")  # magic, transfer_id, total payload bytes
# Set explicitly, which turns the kernel's autotuning off: 4 MiB is net.core.{w,r}mem_max's
# default (the kernel grants twice that). On loopback no slower than autotuning, and steadier.
SOCKET_BUFFER_BYTES = 4 << 20


def _iov_max() -> int:
    """Buffers one sendmsg / recvmsg_into may take (Linux: 1024); POSIX guarantees 16."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return limit if limit >= 16 else 1024


IOV_MAX = _iov_max()


def encode_address(host: str, port: int) -> bytes:
    """The producer's data listener as published in the directory."""
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()


def parse_address(address: bytes) -> tuple[str, int]:
    """Inverse of `encode_address`.

    Raises:
        ValueError: not `host:port`.
    """
    host, sep, port = address.decode("ascii").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


def tune(sock: socket.socket) -> None:
    """Low latency for the small frames, big buffers for the payload."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
