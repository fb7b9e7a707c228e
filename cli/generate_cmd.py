"""`kvwire generate`: a small client of the router's completions API.

The transfer statistics come from the answer's `kvwire` object (the router over kvwire's nodes), or from its
x-kvwire-* headers (the router in front of vLLM servers: the path, its reason and the instances).
"""

from __future__ import annotations

import json
from typing import Annotated, NoReturn

import httpx2
import typer


def generate(prompt: Annotated[str, typer.Argument(help="Prompt text.")],
             url: Annotated[str, typer.Option("--url", help="Router base URL.")] = "http://127.0.0.1:8000",
             max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens to generate.")] = 32,
             temperature: Annotated[float, typer.Option("--temperature", min=0.0,
                                                        help="0 is greedy.")] = 0.0,
             seed: Annotated[int | None, typer.Option("--seed", help="Seed of the sampler.")] = None,
             stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print tokens as they come.")] = False,
             timeout: Annotated[float, typer.Option("--timeout", min=0.001, help="Seconds.")] = 120.0) -> None:
    """Send one completion request and print the text and the transfer statistics."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": stream}
    try:
        with httpx2.Client(timeout=timeout) as client:
            if stream:
                _stream(client, url, body)
            else:
                _complete(client, url, body)
    except httpx2.HTTPError as exc:  # nothing listening, a timeout, a broken connection
        typer.echo(f"kvwire generate: {url}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None


def _complete(client: httpx2.Client, url: str, body: dict) -> None:
    resp = client.post(f"{url}/v1/completions", json=body)
    if resp.status_code != 200:
        _refused(resp.status_code, resp.text)
    data = resp.json()
    typer.echo(data["choices"][0]["text"])
    _report(data.get("kvwire"), resp.headers)


def _stream(client: httpx2.Client, url: str, body: dict) -> None:
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            _refused(resp.status_code, resp.read().decode(errors="replace"))
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                typer.echo(f"\nerror: {data['error']['message']}", err=True)
                raise typer.Exit(1)
            if data.get("choices"):
                typer.echo(data["choices"][0]["text"], nl=False)
            if "kvwire" in data:
                typer.echo("")
                _report(data["kvwire"], resp.headers)
                return
        typer.echo("")
        _report(None, resp.headers)


def _refused(status: int, text: str) -> NoReturn:
    """An answer other than 200: the OpenAI error's message where the body is one, else the body's start."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:300]
    typer.echo(f"error {status}: {message}", err=True)
    raise typer.Exit(1)


def _report(kvwire: dict | None, headers: httpx2.Headers) -> None:
    """The transfer statistics, on stderr: the `kvwire` object, else the x-kvwire-* headers, else nothing."""
    report = kvwire or {k.removeprefix("x-kvwire-"): v for k, v in headers.items() if k.startswith("x-kvwire-")}
    if report:
        typer.echo(f"kvwire: {json.dumps(report)}", err=True)
