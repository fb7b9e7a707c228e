"""Where kvwire keeps what it creates for the user (the default tiny checkpoint).

The checkpoint is written once, into a directory of its own beside the final one, and
renamed into place whole: two `kvwire up` or `demo` started at once on a fresh machine
never load a half-written one (the loser of the rename drops its copy). A checkpoint left
by a kvwire that wrote no chat template gets one, so `/v1/chat/completions` answers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TINY_PRESET, TINY_SEED = "tiny", 0


def default_model_dir() -> Path:
    """The tiny checkpoint `up` and `demo` use when no --model is given; created on first use."""
    from kvwire.engine.byte_tokenizer_files import CHAT_TEMPLATE_FILE

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "kvwire" / "models" / f"{TINY_PRESET}-seed{TINY_SEED}"
    if not (path / "config.json").is_file():
        _write_whole(path)
    elif not (path / CHAT_TEMPLATE_FILE).is_file():
        _add_chat_template(path)
    return path


def _write_whole(path: Path) -> None:
    """Write the checkpoint and its chat template beside `path`, then rename it to `path`."""
    from kvwire.engine.byte_tokenizer_files import write_chat_template
    from kvwire.engine.init_model import write_random_checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    write_random_checkpoint(staging, TINY_PRESET, TINY_SEED)
    write_chat_template(staging)
    try:
        staging.rename(path)
    except OSError:  # another process renamed its copy first (or left a partial one we must not replace)
        shutil.rmtree(staging, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise


def _add_chat_template(path: Path) -> None:
    """Give a checkpoint an older kvwire wrote its chat template (written aside, renamed in)."""
    from kvwire.engine.byte_tokenizer_files import CHAT_TEMPLATE_FILE, write_chat_template

    staging = path.with_name(f".{path.name}.{os.getpid()}.template")
    written = write_chat_template(staging)
    os.replace(written, path / CHAT_TEMPLATE_FILE)
    shutil.rmtree(staging, ignore_errors=True)
