"""`kvwire status`: the directory's live nodes and in-flight transfers, as a table or JSON."""

from __future__ import annotations

from typing import Annotated

import typer

from kvwire.cli.options import RedisUrl
from kvwire.cluster.status import read_status, render, to_json
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory


def status(redis_url: RedisUrl,
           json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False) -> None:
    """Show the live nodes (role, address, load, free blocks, heartbeat age) and the transfers in the directory."""
    directory = KVDirectory(redis_url)
    try:
        snapshot = read_status(directory)
    except DirectoryError as exc:
        typer.echo(f"kvwire status: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        directory.close()
    typer.echo(to_json(snapshot) if json_out else render(snapshot))
