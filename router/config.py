"""The router process's configuration, built in `cli/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RouterConfig:
    """Attributes:
    model_dir: checkpoint whose tokenizer and context length the router uses.
    redis_url: the directory.
    host, port: where the HTTP API listens.
    request_timeout_s: a request with no final answer by then gets a 504.
    model_name: the id served in /v1/models; the checkpoint directory's name by default.
    auth_secret: shared secret sealing control messages to and from nodes; None: no authentication.
    """

    model_dir: Path
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 120.0
    model_name: str = ""
    auth_secret: bytes | None = field(default=None, repr=False)

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model_dir.name
