"""A private Redis Sentinel on loopback watching a `LocalRedis` master, for tests of `redis+sentinel://` URLs.

Lifecycle:

1. `LocalSentinel(master, ...)` only records its options.
2. `start()` writes a sentinel.conf into a temp dir (Sentinel rewrites its config file, so
   it needs one of its own), runs the same redis-server binary in sentinel mode on a free
   port, and returns once the sentinel logs that it monitors the master.
3. `stop()` terminates it and removes the dir.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

from kvwire.cluster.ports import free_port
from kvwire.cluster.redis_server import LocalRedis, LocalRedisError, _Server, find_redis_server

_MONITOR_MARKER = b"+monitor master"


class LocalSentinel:
    """One sentinel monitoring `master` as `service`.

    Args:
        master: the LocalRedis to monitor (started); its password, if any, is given to the sentinel.
        service: the master's name in the sentinel.
        password: if set, clients of the sentinel itself must AUTH with it.
        startup_timeout_s: how long `start()` waits for the sentinel to monitor the master.
    """

    def __init__(self, master: LocalRedis, *, service: str = "mymaster", password: str | None = None,
                 startup_timeout_s: float = 10.0):  # fmt: skip
        self.master, self.service, self.password = master, service, password
        self._startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self._dir: str | None = None
        self._server: _Server | None = None

    def url(self, master_password: str | None = None, tls: bool = False) -> str:
        """`redis+sentinel://[:master_password@]127.0.0.1:port/service/0[?sentinel_password=...]`."""
        auth = f":{master_password}@" if master_password else ""
        query = f"?sentinel_password={self.password}" if self.password else ""
        scheme = "rediss+sentinel" if tls else "redis+sentinel"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/{self.service}/0{query}"

    def start(self) -> LocalSentinel:
        """Start the sentinel. Raises LocalRedisError if it does not monitor the master in time."""
        self._dir = tempfile.mkdtemp(prefix="kvwire-sentinel-")
        self.port = free_port()
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self._dir}",
                 f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1"]
        if self.master.password:
            lines.append(f"sentinel auth-pass {self.service} {self.master.password}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        conf = Path(self._dir) / "sentinel.conf"
        conf.write_text("\n".join(lines) + "\n")
        self._server = _Server([str(find_redis_server()), str(conf), "--sentinel"])
        deadline = time.monotonic() + self._startup_timeout_s
        while not any(_MONITOR_MARKER in line for line in list(self._server.tail)):
            if time.monotonic() > deadline or self._server.proc.poll() is not None:
                output = self._server.output()
                self.stop()
                raise LocalRedisError("sentinel did not start monitoring", port=self.port, output=output)
            time.sleep(0.05)  # the log is drained by another thread; nothing to wait on here
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.terminate(signal.SIGTERM, 5.0)
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
