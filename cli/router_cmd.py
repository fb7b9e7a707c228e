"""`kvwire router`: the OpenAI-compatible HTTP front door."""

from __future__ import annotations

from typing import Annotated

import typer

from kvwire.cli.options import AuthSecretFile, Host, LogLevel, ModelDir, RedisUrl, auth_secret, setup_logging
from kvwire.router.config import RouterConfig


def router(model: ModelDir, redis_url: RedisUrl, host: Host = "127.0.0.1",
           port: Annotated[int, typer.Option("--port", min=1, max=65535, help="HTTP port.")] = 8000,
           request_timeout: Annotated[float, typer.Option("--request-timeout", min=0.1,
                                                          help="Seconds before a request gets a 504.")] = 120.0,
           auth_secret_file: AuthSecretFile = None, log_level: LogLevel = "INFO") -> None:
    """Serve POST /v1/completions and GET /v1/models, /healthz, /readyz and /metrics."""
    import uvicorn

    from kvwire.connectors import auth
    from kvwire.engine.gc_pauses import freeze_startup_heap
    from kvwire.router.app import create_app

    setup_logging(log_level)
    config = RouterConfig(model_dir=model, redis_url=redis_url, host=host, port=port, request_timeout_s=request_timeout,
                          auth_secret=auth_secret(auth_secret_file))
    auth.install(config.auth_secret)  # before any socket opens
    app = create_app(config)
    freeze_startup_heap()  # the router's heap holds torch and the tokenizer too
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), access_log=False)
