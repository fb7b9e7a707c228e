"""`kvwire demo`: a private cluster, a handful of prompts, and a check against one process.

1. The prompts' tokens from one process (engine/reference.py): what the cluster must answer.
2. A local cluster starts; the demo goes on once the router can disaggregate (its /readyz: a live prefill
   node and decode node, both warmed up before they registered).
3. One prompt is asked TTFT_REQUESTS times (each led by its own number, so that no prefix cache holds it), one
   request at a time: the first request's time to first token against the tenth's shows whether the nodes'
   warm-up worked (on a GPU, the first within 2x the tenth).
4. Every prompt is sent at once; the table shows how each one's KV travelled, and each output is compared.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import httpx2
import typer

from kvwire.bench.prompts import PROMPTS
from kvwire.cli.extras import for_cluster, require
from kvwire.cli.options import Connector, LogLevel, Warmup, check_device, setup_logging
from kvwire.cli.up_cmd import cluster_of
from kvwire.cluster.local_cluster import ClusterSpec
from kvwire.cluster.paths import default_model_dir
from kvwire.connectors.config import ConnectorKind
from kvwire.protocol.work import SamplingParams

TTFT_REQUESTS = 10  # asked one at a time: the first request's TTFT against the tenth's
TTFT_PROMPT = PROMPTS[4]  # 135 tokens: a prompt that is neither one block nor a long one


@dataclass
class Row:
    prompt_tokens: int
    expected: list[int]
    got: list[int] | None = None
    kvwire: dict | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.got == self.expected and bool(self.kvwire and self.kvwire["bypassed"])


def _ask(url: str, prompt: str, params: SamplingParams) -> dict:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "return_token_ids": True}
    resp = httpx2.post(f"{url}/v1/completions", json=body, timeout=120.0)
    data = resp.json()
    if resp.status_code != 200:
        raise RuntimeError(data["error"]["message"])
    return data


def _first_requests(url: str, prompt_tokens: int) -> str:
    """Ask TTFT_PROMPT TTFT_REQUESTS times, one request at a time, each led by its number (a failure ends the
    series); the line that compares the first request's time to first token with the tenth's (or the last's, when
    fewer came)."""
    ttfts: list[float] = []
    paths: list[str] = []
    for i in range(TTFT_REQUESTS):
        try:  # each its own first token: no node's prefix cache holds any of the next one
            report = _ask(url, f"{i} {TTFT_PROMPT}", SamplingParams(max_tokens=1, temperature=0.0))["kvwire"]
        except Exception as exc:  # noqa: BLE001 - reported on the line
            if not ttfts:
                return f"time to first token, one request at a time: the first request failed: {exc}"
            break
        ttfts.append(report["ttft_ms"] or 0.0)
        paths.append(report["path"])
    n = len(ttfts)
    nth = "tenth" if n == TTFT_REQUESTS else f"last (#{n})"
    ratio = f"{ttfts[0] / ttfts[-1]:.1f}x" if ttfts[-1] else "-"
    return (f"time to first token, one request at a time (a {prompt_tokens}-token prompt): first request "
            f"{ttfts[0]:.1f} ms ({paths[0]}), {nth} {ttfts[-1]:.1f} ms ({paths[-1]}): the first is {ratio} the "
            f"{nth} (warm nodes on a GPU: within 2x)")


def _table(rows: list[Row]) -> str:
    head = (f"{'#':>2} {'prompt tok':>10} {'out tok':>7} {'bypassed':>8} {'wire':>5} {'KV bytes':>10} {'xfer ms':>8} "
            f"{'GB/s':>6} {'TTFT ms':>8}  match")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows):
        k = r.kvwire or {}
        gbps = k.get("kv_bytes", 0) / (k["transfer_ms"] * 1e6) if k.get("transfer_ms") else 0.0
        ttft = k.get("ttft_ms") or 0.0
        lines.append(f"{i:>2} {r.prompt_tokens:>10} {len(r.got or []):>7} {str(k.get('bypassed', '-')):>8} "
                     f"{k.get('transport') or '-':>5} "
                     f"{k.get('kv_bytes', 0):>10} {k.get('transfer_ms', 0.0):>8.2f} {gbps:>6.2f} {ttft:>8.1f}  "
                     f"{'yes' if r.ok else 'NO ' + (r.error or _why_not_bypassed(k))}")
    return "\n".join(lines)


def _why_not_bypassed(k: dict) -> str:
    """What the answer says of a prompt computed on decode: the failed transfer's reason, or the path's."""
    if not k or k.get("bypassed"):
        return ""
    return f"(transfer_failure {k['transfer_failure']})" if k.get("transfer_failure") else f"({k.get('reason')})"


def demo(model: Annotated[Path | None, typer.Option("--model", help="Checkpoint; a tiny random one by default.")]
         = None,
         connector: Connector = ConnectorKind.AUTO,
         max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens to generate per prompt.")] = 24,
         device: Annotated[str, typer.Option("--device", help="torch device of both nodes and of the single-process "
                                             "run, e.g. cpu or cuda:0.")] = "cpu",
         warmup: Warmup = True, log_level: LogLevel = "WARNING") -> None:
    """Serve a few prompts through prefill → KV transfer → decode and compare with one process."""
    require("demo", *for_cluster(connector, None))  # before torch's import, which a router's install lacks

    from kvwire.engine.reference import generate
    from kvwire.engine.tokenizer import load_tokenizer

    check_device(device)
    setup_logging(log_level)
    model_dir = model or default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    typer.echo(f"single-process reference on {model_dir} ({device}) ...")
    rows = [Row(len(ids), out) for ids, out in zip(prompt_ids, generate(model_dir, prompt_ids, params, device=device))]
    typer.echo(f"starting a local cluster (connector {connector}, both nodes on {device}) ...")
    started = time.monotonic()
    spec = ClusterSpec(model_dir=model_dir, connector=connector, log_level=log_level, prefill_device=device,
                       decode_device=device, warmup=warmup)
    with cluster_of(spec, "demo") as cluster:
        typer.echo(f"cluster ready to disaggregate in {time.monotonic() - started:.1f}s at {cluster.url} "
                   f"(nodes {'warmed up' if warmup else 'not warmed up: --no-warmup'})")
        typer.echo(_first_requests(cluster.url, len(tokenizer.encode(f"0 {TTFT_PROMPT}"))))
        typer.echo(f"sending {len(PROMPTS)} prompts at once")
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(_ask, cluster.url, p, params) for p in PROMPTS]
            for row, fut in zip(rows, futures):
                try:
                    data = fut.result()
                    row.got, row.kvwire = data["choices"][0]["token_ids"], data["kvwire"]
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    row.error = str(exc)
    typer.echo(_table(rows))
    bad = [i for i, r in enumerate(rows) if not r.ok]
    if bad:
        typer.echo(f"FAILED: rows {bad} differ from the single-process run or were not bypassed", err=True)
        raise typer.Exit(1)
    typer.echo(f"all {len(rows)} outputs identical to the single-process run, every prompt's forward skipped on decode")
