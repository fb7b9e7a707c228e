"""The producer's Unix socket: where it lives, who may connect, one message per packet.

Lifecycle of a socket:

1. Each producer incarnation listens on `<root>/kvwire-<uid>/<node>.<epoch>.<pid>.sock`
   (the pid keeps two clusters on one host that reuse node ids and epochs apart).
2. A producer removes its socket on close.
3. One SIGKILLed leaves it behind, and the next incarnation of the same node id removes
   every socket of that node whose process is gone and on which nothing listens.

The directory `<root>/kvwire-<uid>` is created 0700 and refused if anyone else owns it or
could enter it, so no other user can connect (and, as a second check, both ends compare
the peer's uid from SO_PEERCRED with their own). The socket is SOCK_SEQPACKET: one wire
message per packet, file descriptors (SCM_RIGHTS) attached to the message they belong to.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import select
import socket
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.wire import AnyMessage, Message, WireError

log = logging.getLogger(__name__)

SOCKET_ROOT = Path("/tmp")
MAX_PACKET = 64 << 10  # every message on this socket is far smaller
MAX_FDS = 2
_SAFE_NODE = re.compile(r"[A-Za-z0-9_-]{1,48}")


def socket_dir(root: Path = SOCKET_ROOT) -> Path:
    """This user's private socket directory under `root`, created 0700 if missing.

    Raises:
        PermissionError: it exists but is not a directory owned by us with mode 0700.
    """
    path = root / f"kvwire-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 "
                              f"(found mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); remove it")
    return path


def node_prefix(node_id: str) -> str:
    """A file-name-safe, bounded stand-in for a node id."""
    if _SAFE_NODE.fullmatch(node_id):
        return node_id
    return "n" + hashlib.sha256(node_id.encode()).hexdigest()[:32]


def socket_path(directory: Path, node_id: str, epoch: int) -> Path:
    return directory / f"{node_prefix(node_id)}.{epoch}.{os.getpid()}.sock"


def remove_stale(directory: Path, node_id: str, keep: Path | None = None) -> list[Path]:
    """Unlink the sockets of dead incarnations of `node_id`.

    Dead: its process is gone (or its pid is now ours: a container restarted with the
    same pid) and nothing listens on it. A live process between bind and listen is
    spared by the first test, one in another pid namespace by the second.

    Returns:
        The paths removed.
    """
    pattern = re.compile(re.escape(node_prefix(node_id)) + r"\.\d+\.(\d+)\.sock")
    removed = []
    for path in directory.iterdir():
        match = pattern.fullmatch(path.name)
        if path == keep or match is None or _pid_alive(int(match.group(1))) or _listening(path):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        log.info("node %s: removed the socket of a dead incarnation: %s", node_id, path)
        removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    """True for a running process other than us (a zombie is not running)."""
    if pid == os.getpid():
        return False
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat_line.rpartition(")")[2].split()[:1] != ["Z"]


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:  # not a socket we can judge: leave it alone
        log.warning("cannot tell whether %s is live (%s); leaving it", path, exc)
        return True
    finally:
        probe.close()
    log.warning("%s belongs to a live process with the same node id; leaving it", path)
    return True


def listen(path: Path) -> socket.socket:
    """A non-blocking SOCK_SEQPACKET listener bound at `path` (mode 0600)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(path: str, timeout_s: float) -> socket.socket:
    """A blocking connection to a producer's socket, checked to belong to our own user.

    Raises:
        OSError: cannot connect (no such socket, refused, timed out).
        PermissionError: the listener runs as another user.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(timeout_s, 1e-3))
        sock.connect(path)
        _, uid = peer_cred(sock)
        if uid != os.getuid():
            raise PermissionError(f"{path} is served by uid {uid}, not ours ({os.getuid()})")
    except BaseException:
        sock.close()
        raise
    return sock


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """The connected peer's (pid, uid), as the kernel recorded them."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def hung_up(sock: socket.socket) -> bool:
    """True when the peer has closed the connection (checked without waiting)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return any(ev & (select.POLLHUP | select.POLLRDHUP | select.POLLERR) for _, ev in poller.poll(0))


def send_msg(sock: socket.socket, msg: Message, fds: Sequence[int] = ()) -> None:
    """Send one message, with `fds` attached (duplicated into the peer) when given."""
    data = pack(msg)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_msg(sock: socket.socket, expect: type | tuple[type, ...]) -> tuple[AnyMessage, list[int]]:
    """Receive one message and the file descriptors attached to it (the caller closes them).

    Raises:
        BlockingIOError / TimeoutError: nothing yet (non-blocking socket / timeout).
        ConnectionError: the peer closed the connection.
        WireError: not one valid message of the expected types.
    """
    data, fds, flags, _ = socket.recv_fds(sock, MAX_PACKET, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    try:
        if not data and not fds:
            raise ConnectionResetError("peer closed the connection")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise WireError("message or its file descriptors were truncated")
        return unpack(data, expect=expect), fds
    except BaseException:
        close_fds(fds)
        raise


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
