"""Where kvwire keeps what it creates for the user (the default tiny checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path


def default_model_dir() -> Path:
    """The tiny checkpoint `up` and `demo` use when no --model is given; created on first use."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "kvwire" / "models" / "tiny-seed0"
    if not (path / "config.json").is_file():
        from kvwire.engine.init_model import write_random_checkpoint

        write_random_checkpoint(path, "tiny", 0)
    return path
