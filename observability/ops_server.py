"""A node's operations endpoint: GET /healthz, /readyz and /metrics over plain HTTP.

Lifecycle:

1. `start()` binds host:port (0 picks a free port, see `port`) and serves from a daemon
   thread; /readyz answers 503 (the node is still loading its model or registering).
2. `set_ready_check` gives it a check, and what to say below "ready" / "not ready" (the
   node's transport self-test); /readyz answers from then on by that check.
3. `close()` stops serving.

Used as a context manager it starts and closes itself; with port None it does nothing, so
a node started without --http-port needs no special case.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvwire.observability.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)

BIND_PATIENCE_S = 2.0  # how long a port held by someone else is waited for before start-up fails


class OpsServer:
    """Serves /healthz (alive: 200), /readyz (200 when the ready check passes, else 503) and /metrics.

    Args:
        host: address to bind.
        port: TCP port; 0 picks a free one; None disables the server.
        metrics: what /metrics exposes.
    """

    def __init__(self, host: str, port: int | None, metrics: Metrics):
        self.host = host
        self._port = port
        self._metrics = metrics
        self._ready_check: Callable[[], bool] = lambda: False
        self._ready_details: Callable[[], list[str]] = list
        self._server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server is not None else self._port

    def set_ready_check(self, check: Callable[[], bool], details: Callable[[], list[str]] = list) -> None:
        """From now on /readyz answers 200 exactly when `check()` returns True (an exception counts as False),
        its body "ready" or "not ready", then a line for each of `details()`."""
        self._ready_check = check
        self._ready_details = details

    def ready(self) -> bool:
        try:
            return bool(self._ready_check())
        except Exception as exc:  # noqa: BLE001 - a failing check means "not ready", never a 500
            log.warning("readiness check failed: %s", exc)
            return False

    def start(self) -> OpsServer:
        if self._port is None or self._server is not None:
            return self
        self._server = self._bind()
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="ops-http", daemon=True).start()
        log.info("ops endpoint on http://%s:%d (/healthz /readyz /metrics)", self.host, self.port)
        return self

    def _bind(self, patience_s: float = BIND_PATIENCE_S) -> ThreadingHTTPServer:
        """The server on its port. A port given out by a launcher (cluster/ports.py) can be held for a moment
        by another process's check of it: EADDRINUSE is retried for `patience_s`, then raised."""
        assert self._port is not None  # start() serves nothing without one
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return ThreadingHTTPServer((self.host, self._port), _handler(self))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise OSError(exc.errno, f"ops endpoint http://{self.host}:{self._port}: {exc.strerror}") from exc
            time.sleep(0.05)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> OpsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of `path`."""
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if path == "/readyz":
            ok = self.ready()
            body = "".join(f"{line}\n" for line in ["ready" if ok else "not ready", *self._ready_details()])
            return 200 if ok else 503, "text/plain; charset=utf-8", body.encode()
        if path == "/metrics":
            return 200, CONTENT_TYPE, self._metrics.exposition()
        return 404, "text/plain; charset=utf-8", b"not found\n"


def _handler(ops: OpsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, content_type, body = ops.respond(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
            log.debug("ops %s - %s", self.address_string(), format % args)

    return Handler
