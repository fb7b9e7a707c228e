"""`kvwire bench ...`: benchmarks of the transfer plane."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvwire.bench.choices import Device, Method, Placement
from kvwire.bench.procs import log_everywhere
from kvwire.cli.bench_vllm_cmd import vllm
from kvwire.cli.extras import NODE, for_cluster, local_unless, require
from kvwire.cli.options import Connector, LogLevel, OptionalRedisUrl, csv_of, redis_url_of
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.wire import PoolLayout

app = typer.Typer(help="Benchmarks of the transfer plane.", no_args_is_help=True)


@app.command()
def transfer(
    tokens: Annotated[str, typer.Option("--tokens", help="Request sizes in tokens, comma-separated.")] =
        "128,2048,16384",
    methods: Annotated[str, typer.Option("--methods", help=f"Comma-separated, of: {', '.join(Method)}. NIXL's "
                                         "rows name the UCX protocol it used; without NIXL installed they are "
                                         "skipped, saying so.")] =
        "limit-memcpy,limit-tcp,nixl,nixl-tcp,ucx,ucx-tcp,shm,tcp,nccl,auto",
    placements: Annotated[str, typer.Option("--layouts", help="scattered and/or contiguous.")] = "scattered,contiguous",
    pools: Annotated[str, typer.Option("--pools", help="Whose pool layout: kvwire (block-major) and/or vllm "
                                       "(per-layer K and V). A method that refuses a pool says why in its "
                                       "row.")] =
        "kvwire,vllm",
    runs: Annotated[int, typer.Option("--runs", min=1, help="Measured runs per figure (the median is reported).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Unmeasured runs first.")] = 1,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Passes over all methods, interleaved; each "
                                        "figure pools the runs of every pass (evens out a noisy machine).")] = 1,
    device: Annotated[Device, typer.Option("--device", help="Where both pools live; cuda runs the methods that "
                                           "move device memory on one GPU (limit-memcpy, limit-gather, ucx, shm, tcp, "
                                           "auto; nixl with cuda_ipc's get enabled, nixl-defaults on UCX's "
                                           "defaults).")]
        = Device.CPU,
    hidden_width: Annotated[int, typer.Option("--hidden-width", min=1, help="float32 values per token of the "
                                              "hidden states kvwire's connectors carry beside the KV (2048 for "
                                              "Llama-3-8B's 8 KiB a token: 4096 bf16 values); their time counts, "
                                              "their bytes not. Peers and limits move KV only.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON instead of a table.")] = False,
    plot: Annotated[str | None, typer.Option("--plot", help="Also draw GB/s against size to this PNG file.")] = None,
    layerwise: Annotated[bool, typer.Option("--layerwise", help="Instead: stream layer by layer (the chosen "
                                            "methods among tcp and ucx, as `kvwire prefill --layerwise`) behind a "
                                            "simulated prefill and report how much of the transfer it hides.")]
        = False,
    compute_ms: Annotated[float | None, typer.Option("--compute-ms-per-layer", min=0.0, help="With --layerwise: "
                                                     "compute per layer; default one layer's transfer time.")] = None,
    redis_url: OptionalRedisUrl = None,
    log_level: LogLevel = "WARNING",
) -> None:
    """Move one Llama-3-8B-shaped request's KV (32 layers, 8 KV heads, head dim 128, bf16, block size 16)
    between two processes with each method, next to the machine's limits; bytes verified every run."""
    require("bench transfer", NODE, *local_unless(redis_url))

    from tqdm import tqdm

    from kvwire.bench.report import PROTOCOL_HEADING, protocol_lines, table, to_json
    from kvwire.bench.transfer import bench_transfer, combinations, supports, target_lines, unavailable
    from kvwire.cluster.redis_server import LocalRedis

    sizes = csv_of(tokens, int)
    chosen, where, whose = csv_of(methods, Method), csv_of(placements, Placement), csv_of(pools, PoolLayout)
    log_everywhere(log_level)  # DEBUG: each UCX pull's time, where it went, on both sides
    if layerwise and device != Device.CPU:
        raise typer.BadParameter("--layerwise runs on host memory only", param_hint="--device")
    if device == Device.CUDA:
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("no CUDA device on this machine", param_hint="--device")
    with LocalRedis() if redis_url is None else contextlib.nullcontext() as redis:
        if layerwise:
            _layerwise(chosen, sizes, where, whose, runs, warmup, compute_ms, as_json, redis_url_of(redis_url, redis),
                       hidden_width)
            return
        total = rounds * combinations(chosen, sizes, where, whose, device)
        with tqdm(total=total, desc="bench transfer", file=sys.stderr) as bar:
            def on_row(row):
                bar.set_postfix_str(f"{row.method} {row.tokens} {row.layout} {row.pool}: {row.gbps_median:.2f} GB/s")
                bar.update()

            rows = bench_transfer(chosen, sizes, where, whose, runs, warmup, redis_url_of(redis_url, redis), on_row,
                                  rounds, device, hidden_width)
    typer.echo(to_json(rows).decode() if as_json else table(rows))
    skipped = [f"{m}: skipped: {why}" for m, why in unavailable([m for m in chosen if supports(m, device)]).items()]
    if skipped:
        typer.echo(("\n" if not as_json else "") + "\n".join(skipped), err=as_json)
    if not as_json and (protocols := protocol_lines(rows)):
        typer.echo(f"\n{PROTOCOL_HEADING}\n" + "\n".join(protocols))
    if not as_json and (targets := target_lines(rows)):
        typer.echo("\nratios of medians (the performance issue's targets):\n" + "\n".join(targets))
    if plot:
        from kvwire.bench.plot import plot_rows

        plot_rows(rows, plot)
        typer.echo(f"plot written to {plot}", err=True)
    if not all(r.verified for r in rows):
        failed = sum(r.error is not None for r in rows)
        typer.echo("some transfers did not verify" + (f"; {failed} did not run (their rows say why)" if failed else ""),
                   err=True)
        raise typer.Exit(1)


# `bench directory`'s defaults, per mode: a request's directory life, or (--nodes) listing nodes.
LIFE_DEFAULTS = (20000, 256)  # --requests, --batch
LISTING_DEFAULTS = (20000, 10, 200)  # --entries, --routers, --listings


@app.command()
def directory(
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests whose directory life is measured.")]
        = LIFE_DEFAULTS[0],
    batch: Annotated[int, typer.Option("--batch", min=1, help="Requests per pipelined round trip.")] = LIFE_DEFAULTS[1],
    nodes: Annotated[int, typer.Option("--nodes", min=0, help="Instead: register this many nodes and measure what "
                                       "listing them costs Redis and a router (bench/node_listing.py).")] = 0,
    entries: Annotated[int, typer.Option("--entries", min=0, help="With --nodes: request entries beside them.")]
        = LISTING_DEFAULTS[0],
    routers: Annotated[int, typer.Option("--routers", min=1, help="With --nodes: routers listing, for the rate.")]
        = LISTING_DEFAULTS[1],
    listings: Annotated[int, typer.Option("--listings", min=1, help="With --nodes: listings measured.")]
        = LISTING_DEFAULTS[2],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    redis_url: OptionalRedisUrl = None,
) -> None:
    """Directory throughput (pipelined publish + lookup + CAS + delete) and one request's round-trip latency
    against a real redis-server (a private one unless --redis-url); with --nodes, the cost of listing nodes."""
    require("bench directory", *local_unless(redis_url))

    import msgspec

    from kvwire.cluster.redis_server import LocalRedis

    if nodes and (requests, batch) != LIFE_DEFAULTS:
        raise typer.BadParameter("--requests and --batch measure a request's directory life; --nodes measures "
                                 "listing nodes instead")
    if not nodes and (entries, routers, listings) != LISTING_DEFAULTS:
        raise typer.BadParameter("--entries, --routers and --listings go with --nodes")
    if nodes:
        from kvwire.bench.node_listing import bench_node_listing

        with LocalRedis() if redis_url is None else contextlib.nullcontext() as redis:
            listed = bench_node_listing(redis_url_of(redis_url, redis), nodes, entries, routers, listings)
        typer.echo(msgspec.json.format(msgspec.json.encode(listed), indent=2).decode())
        if not listed.verified:
            raise typer.Exit(1)
        return
    from kvwire.bench.directory import bench_directory

    with LocalRedis() if redis_url is None else contextlib.nullcontext() as redis:
        result = bench_directory(redis_url_of(redis_url, redis), requests, batch)
    if as_json:
        typer.echo(msgspec.json.format(msgspec.json.encode(result), indent=2).decode())
    else:
        typer.echo(f"pipelined ({batch} requests per round trip): {result.ops_per_s:,.0f} ops/s "
                   f"({result.requests_per_s:,.0f} requests/s, 4 ops each)\n"
                   f"one request's round trip (publish, lookup, CAS, delete): p50 {result.roundtrip_p50_ms:.3f} ms, "
                   f"p99 {result.roundtrip_p99_ms:.3f} ms (3 round trips, as the nodes make them)\n"
                   f"bare PING from the same client, for scale: p50 {result.ping_p50_ms:.3f} ms, "
                   f"p99 {result.ping_p99_ms:.3f} ms; three in a row, after each request's round trip: p50 "
                   f"{result.three_pings_p50_ms:.3f} ms, p99 {result.three_pings_p99_ms:.3f} ms\n"
                   f"verified: {'yes' if result.verified else 'NO'}")
    if not result.verified:
        raise typer.Exit(1)


@app.command()
def e2e(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint; the tiny random one by default.")] = None,
    connector: Connector = ConnectorKind.AUTO,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Sequential passes over the prompt mix per mode.")]
        = 5,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Tokens generated per request.")] = 16,
    layerwise: Annotated[bool, typer.Option("--layerwise", help="The prefill node streams KV layer by layer "
                                            "(needs --connector tcp or ucx).")] = False,
    bare: Annotated[bool, typer.Option("--bare/--no-bare", help="Also time the bare chain (the same engine in "
                                       "two processes, no kvwire) for the gap that is the host's.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """The demo's prompt mix through the router, disaggregated and single-node prompt by prompt on one
    cluster: TTFT, time per output token, throughput, and the TTFT gap against the transfer time; then
    the same requests through the bare chain, whose gap is what disaggregating costs here without kvwire."""
    require("bench e2e", *for_cluster(connector, None))
    from kvwire.connectors.config import LAYERWISE_KINDS

    if layerwise and connector not in LAYERWISE_KINDS:
        raise typer.BadParameter("layer-wise streaming runs over the tcp and ucx connectors", param_hint="--layerwise")
    import msgspec

    from kvwire.bench.e2e import bench_e2e
    from kvwire.cluster.paths import default_model_dir

    result = bench_e2e(model or default_model_dir(), connector, rounds, max_tokens, layerwise, bare)
    if as_json:
        typer.echo(msgspec.json.format(msgspec.json.encode(result), indent=2).decode())
    else:
        typer.echo(_e2e_table(result))
    if not result.outputs_equal:
        typer.echo("outputs differ between the two modes", err=True)
        raise typer.Exit(1)


def _e2e_table(result) -> str:
    from kvwire.bench.e2e import GAP_SLACK_MS

    head = (f"{'mode':<14} {'requests':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'req/s':>7} {'tok/s':>8} "
            f"{'xfer p50':>9} {'bypassed':>8}")
    lines = [head, "-" * len(head)]
    for m in result.modes:
        lines.append(f"{m.mode:<14} {m.requests:>8} {m.ttft_ms_p50:>9.2f} {m.ttft_ms_p99:>8.2f} {m.tpot_ms_p50:>9.3f} "
                     f"{m.throughput_rps:>7.2f} {m.throughput_tok_s:>8.1f} {m.transfer_ms_p50:>9.2f} {m.bypassed:>8}")
    lines.append(f"TTFT gap (disaggregated - single-node, median over prompts): {result.ttft_gap_ms_p50:.2f} ms; "
                 f"allowed: median transfer + {GAP_SLACK_MS:g} ms = {result.allowed_gap_ms:.2f} ms; "
                 f"outputs equal: {'yes' if result.outputs_equal else 'NO'}")
    lines.append(f"prompt forward, mean over the sequential requests: prefill node "
                 f"{result.forward_ms_prefill_node:.2f} ms (disaggregated), "
                 f"decode node {result.forward_ms_decode_node:.2f} ms (single-node)")
    lines.append(f"means over the sequential requests: TTFT gap {result.ttft_gap_ms_mean:.2f} ms, of which the prompt "
                 f"forward's difference {result.forward_gap_ms:.2f} ms; "
                 f"the rest {result.gap_beside_forward_ms:.2f} ms against mean transfer + {GAP_SLACK_MS:g} ms = "
                 f"{result.transfer_ms_mean + GAP_SLACK_MS:.2f} ms")
    if result.bare_gap_ms_p50 is not None:
        lines.append(f"bare chain (no kvwire: two engine processes, zmq on loopback), TTFT gap "
                     f"{result.bare_gap_ms_p50:.2f} ms; the cluster's gap less it (kvwire's own) "
                     f"{result.kvwire_gap_ms:.2f} ms against "
                     f"{result.allowed_gap_ms:.2f} ms")
    return "\n".join(lines)


def _layerwise(chosen: list[Method], sizes: list[int], where: list[Placement], whose: list[PoolLayout], runs: int,
               warmup: int, compute_ms: float | None, as_json: bool, redis_url: str, hidden_width: int) -> None:
    import msgspec

    from kvwire.bench.layerwise import bench_layerwise
    from kvwire.bench.workload import Workload
    from kvwire.connectors.config import LAYERWISE_KINDS, ConnectorKind

    kinds = [ConnectorKind(m.value) for m in chosen if m.value in LAYERWISE_KINDS]
    if not kinds:
        raise typer.BadParameter(f"--layerwise streams over {', '.join(sorted(LAYERWISE_KINDS))}",
                                 param_hint="--methods")
    results = [bench_layerwise(Workload(n, p, pool, hidden_width=hidden_width), kind, runs, warmup, compute_ms,
                               redis_url)
               for kind in kinds for n in sizes for p in where for pool in whose]
    if as_json:
        typer.echo(msgspec.json.format(msgspec.json.encode(results), indent=2).decode())
    else:
        head = (f"{'method':<6} {'tokens':>6} {'pool':<6} {'xfer ms':>8} {'layer ms':>9} {'compute/layer':>13} "
                f"{'tail ms':>8} {'tail/layer':>10} {'hidden':>7}  verified")
        typer.echo("\n".join([head, "-" * len(head)] + [
            f"{r.method:<6} {r.tokens:>6} {r.pool:<6} {r.transfer_ms:>8.2f} {r.layer_transfer_ms:>9.3f} "
            f"{r.compute_ms_per_layer:>13.3f} {r.tail_ms:>8.3f} {r.tail_over_layer:>10.2f} {r.hidden_fraction:>7.1%}  "
            f"{'yes' if r.verified else 'NO'}"
            for r in results]))
    if not all(r.verified for r in results):
        raise typer.Exit(1)


@app.command()
def load(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint; the tiny random one by default.")] = None,
    connector: Connector = ConnectorKind.AUTO,
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests sent in the measured phase.")] = 1000,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Clients sending at once.")] = 64,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens generated per request.")] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the random prompts and their order.")] = 0,
    kv_deadline: Annotated[float, typer.Option("--kv-deadline", min=0.1, help="The nodes' KV deadline (s): "
                                               "KV later than this is recomputed on decode.")] = 10.0,
    rss_tolerance_mib: Annotated[float, typer.Option("--rss-tolerance-mib", min=0.0, help="Allowed RSS growth of "
                                                     "each process from after the warm-up to after the load.")] = 64.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Many concurrent clients through the router: throughput, TTFT and latency percentiles; every output
    checked against one process; afterwards both KV pools full, the directory empty and RSS back near its
    warm-up value. Exits 1 if anything was lost, errored or differed, or memory did not return."""
    require("bench load", *for_cluster(connector, None))

    import msgspec

    from kvwire.bench.load import LoadConfig, bench_load, table
    from kvwire.cluster.paths import default_model_dir

    cfg = LoadConfig(model_dir=model or default_model_dir(), connector=connector, requests=requests,
                     concurrency=concurrency, max_tokens=max_tokens, seed=seed, kv_deadline_s=kv_deadline,
                     rss_tolerance_mib=rss_tolerance_mib)
    result = bench_load(cfg)
    typer.echo(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() if as_json else table(result))
    if not result.passed:
        typer.echo("FAILED: requests lost, errored or mismatched, or memory did not return", err=True)
        raise typer.Exit(1)


@app.command()
def handoff(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint; the tiny random one by default.")] = None,
    tokens: Annotated[str, typer.Option("--tokens", help="Prompt lengths, comma-separated; by default those "
                                        "of the demo's prompts, which `kvwire bench e2e` sends.")] = "",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Measured prompts per case.")] = 40,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """A prompt forward in the process that served the previous request against one in a process that sat
    idle meanwhile (two engine processes, no kvwire in between): what taking turns on this host costs
    the disaggregated prompt before any KV moves."""
    require("bench handoff", NODE)

    import statistics

    import msgspec

    from kvwire.bench.handoff import bench_handoff, demo_prompt_lengths
    from kvwire.cluster.paths import default_model_dir

    model_dir = model or default_model_dir()
    lengths = csv_of(tokens, int) or demo_prompt_lengths(model_dir)
    results = bench_handoff(model_dir, lengths, rounds)
    if as_json:
        typer.echo(msgspec.json.format(msgspec.json.encode(results), indent=2).decode())
        return
    head = f"{'tokens':>6} {'rounds':>6} {'after itself ms':>15} {'after other ms':>14} {'ratio':>6}"
    extra = statistics.median(r.after_other_ms_p50 - r.after_itself_ms_p50 for r in results)
    typer.echo("\n".join([head, "-" * len(head)] + [
        f"{r.tokens:>6} {r.rounds:>6} {r.after_itself_ms_p50:>15.3f} {r.after_other_ms_p50:>14.3f} {r.ratio:>6.3f}"
        for r in results] + [f"median over the prompts of (after other - after itself): {extra:.3f} ms"]))


app.command()(vllm)
