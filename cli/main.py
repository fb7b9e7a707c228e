"""The `kvwire` command: one sub-command per file in this package."""

from __future__ import annotations

import typer

from kvwire import __version__
from kvwire.cli.bench_cmd import app as bench_app
from kvwire.cli.demo_cmd import demo
from kvwire.cli.generate_cmd import generate
from kvwire.cli.model_cmd import init_model
from kvwire.cli.node_cmd import decode, prefill
from kvwire.cli.redis_cmd import redis
from kvwire.cli.router_cmd import router
from kvwire.cli.status_cmd import status
from kvwire.cli.up_cmd import up

app = typer.Typer(help="kvwire: disaggregated prefill/decode with KV transfer over UCX.",
                  no_args_is_help=True, pretty_exceptions_enable=False)  # --install-completion, --show-completion


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvwire {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print kvwire's version and exit.")) -> None:
    """kvwire: disaggregated prefill/decode with KV transfer over UCX."""
app.command("init-model")(init_model)
app.command()(prefill)
app.command()(decode)
app.command()(router)
app.command()(up)
app.command()(demo)
app.command()(generate)
app.command()(status)
app.command()(redis)
app.add_typer(bench_app, name="bench")

if __name__ == "__main__":
    app()
