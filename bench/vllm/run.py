"""`kvwire bench vllm`: real vLLM servers, single-node against disaggregated, on one prompt mix.

Lifecycle, one setup at a time (bench/vllm/setups.py: the plain server first, then a
KvwireConnector pair per transport, then vLLM's NixlConnector pair):

1. STARTED: the setup's servers (and router) are up; a setup that does not start becomes a
   row saying why (the plain server failing ends the bench: there is nothing to compare with).
   Steps 2-4 run once per way in: a kvwire pair's routers, one per Dispatch (a row each, with
   prompts of their own), or the setup's one URL (the plain server also answers every other
   Dispatch's prompts, unmeasured: the reference tokens).
2. WARMED: one unmeasured pass over the mix.
3. SEQUENTIAL: `rounds` passes over the mix, one streamed request at a time: TTFT and time
   per output token at the client.
4. CONCURRENT (unless concurrency is 0): as many requests again, `concurrency` at a time:
   output tokens per second. Over steps 3 and 4 the cores that processes other than the
   bench's kept busy are noted (bench/vllm/host.py): figures taken on a shared host say so.
5. STOPPED: the decode server's prompt tokens by source are read (how much KV was pulled),
   then every process of the setup is stopped.

Each answer's token ids are checked against the plain server's for the same prompt. A request
that fails (an error status, a broken stream, a timeout) is counted, its reason kept, and left
out of the figures; the setup goes on.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx2
import msgspec

from kvwire.bench.vllm.host import ForeignLoad
from kvwire.bench.vllm.mix import Ask, RequestError, Sample, concurrent_asks, sequential_asks, stream_one
from kvwire.bench.vllm.setups import Dispatch, Setup, SetupKind, Target, failure_reason, nixl_missing, started
from kvwire.cluster.local_cluster import ClusterError
from kvwire.connectors.config import ConnectorKind
from kvwire.observability.labels import ProxyPath

DEFAULT_MIX = (320, 480, 640, 800, 1000)
REQUEST_TIMEOUT_S = 120.0
_PULLED = "external_kv_transfer"  # vllm:prompt_tokens_by_source_total's source for KV a connector moved
_PREFIX = {None: "", Dispatch.ALONGSIDE: "", Dispatch.SEQUENTIAL: "s-"}  # opens the tags of each way in's prompts


@dataclass(frozen=True)
class VLLMBenchConfig:
    model_dir: Path
    redis_url: str  # KvwireConnector's directory
    log_dir: Path  # each setup's server and router logs, in a folder of its own
    transports: tuple[ConnectorKind, ...] = (ConnectorKind.TCP, ConnectorKind.UCX)
    prompt_tokens: tuple[int, ...] = DEFAULT_MIX
    rounds: int = 3
    max_tokens: int = 32
    concurrency: int = 4  # 0: no concurrent pass
    nixl: bool = True
    shapes: tuple[tuple[int, int], ...] = ((1, 1),)  # (prefill TP, decode TP) of the pairs
    dispatches: tuple[Dispatch, ...] = (Dispatch.ALONGSIDE, Dispatch.SEQUENTIAL)  # a kvwire pair's routers
    plain_url: str = ""  # a plain vLLM server already up, serving model_dir, measured as the baseline; "": start one

    def setups(self) -> list[Setup]:
        pairs = [Setup(kind, t, p, d) for p, d in self.shapes
                 for kind, t in [*((SetupKind.KVWIRE, t) for t in self.transports),
                                 *([(SetupKind.NIXL, None)] if self.nixl else [])]]
        return [Setup(SetupKind.PLAIN), *pairs]


class VLLMRow(msgspec.Struct, frozen=True):
    setup: str  # its name in the table: "plain vLLM", "kvwire tcp", ...
    kind: SetupKind
    ran: bool
    reason: str = ""  # why it did not run
    requests: int = 0  # sequential, failed ones included
    errors: int = 0  # requests that failed (warm-up included): left out of every figure
    first_error: str = ""
    ttft_ms_p50: float = 0.0
    ttft_ms_p90: float = 0.0
    tpot_ms_p50: float = 0.0
    tpot_ms_p90: float = 0.0
    latency_ms_p50: float = 0.0  # sending the request to its last chunk
    concurrent_requests: int = 0  # failed ones included
    throughput_tok_s: float = 0.0  # output tokens per second in the concurrent pass
    disaggregated: int = 0  # answers (both passes) the router marked disaggregated
    kv_pulled: float | None = None  # share of the decode server's prompt tokens whose KV a connector moved
    outputs_equal: bool | None = None  # against the plain server's; None for the plain server itself
    mismatched: list[str] = []  # tags of the requests whose tokens differ
    foreign_cores: float | None = None  # cores other processes kept busy during the measured passes


class VLLMBenchResult(msgspec.Struct, frozen=True):
    model: str
    prompt_tokens: list[int]
    rounds: int
    max_tokens: int
    concurrency: int
    rows: list[VLLMRow]

    @property
    def passed(self) -> bool:
        """Every kvwire setup ran and gave the plain server's tokens (NIXL may be missing here)."""
        return all(r.ran and not r.errors and r.outputs_equal is not False
                   for r in self.rows if r.kind != SetupKind.NIXL)


class BenchError(RuntimeError):
    """The baseline (the plain server) did not run: the bench has nothing to compare with."""


def check_plain_server(url: str, model: str) -> None:
    """The server at `url` answers `GET /v1/models` with `model` among its models (the name every request asks for).

    Raises:
        BenchError: it does not answer, or serves other models.
    """
    try:
        r = httpx2.get(f"{url.rstrip('/')}/v1/models", timeout=10)
        r.raise_for_status()
        served = [m.get("id") for m in r.json().get("data", [])]
    except (httpx2.HTTPError, ValueError, AttributeError) as exc:
        raise BenchError(f"the plain vLLM server at {url} did not list its models: {exc}") from exc
    if model not in served:
        raise BenchError(f"the plain vLLM server at {url} serves {served}, not {model!r} (--model): its answers "
                         "could not be compared with the pairs'")


def bench_vllm(cfg: VLLMBenchConfig, on_progress: Callable[[str], None] = lambda _: None) -> VLLMBenchResult:
    """Measure every setup of `cfg` in turn (see the module's docstring).

    Raises:
        BenchError: the plain server did not start, is not serving `cfg.model_dir`, or failed a request.
    """
    if cfg.plain_url:
        check_plain_server(cfg.plain_url, str(cfg.model_dir))
    rows: list[VLLMRow] = []
    reference: dict[str, list[int]] = {}
    for setup in cfg.setups():
        log_dir = cfg.log_dir / setup.slug
        if setup.kind == SetupKind.NIXL and (missing := nixl_missing()):
            rows.append(VLLMRow(setup.name, setup.kind, ran=False, reason=missing))
            continue
        on_progress(f"{setup.name}: starting (logs in {log_dir})")
        try:
            measured, outputs = _measure(setup, cfg, log_dir, reference, on_progress)
        except ClusterError as exc:
            measured, outputs = [VLLMRow(setup.name, setup.kind, ran=False, reason=failure_reason(exc, log_dir))], {}
        for row in measured:
            if setup.kind == SetupKind.PLAIN and (not row.ran or row.errors):
                raise BenchError(f"the plain vLLM server: {row.reason or row.first_error}")
            on_progress(f"{row.setup}: {'done' if row.ran else 'did not run: ' + row.reason}"
                        f"{f'; {row.errors} request(s) failed, the first: {row.first_error}' if row.errors else ''}")
        if setup.kind == SetupKind.PLAIN:
            reference = outputs
        rows += measured
    return VLLMBenchResult(model=str(cfg.model_dir), prompt_tokens=list(cfg.prompt_tokens), rounds=cfg.rounds,
                           max_tokens=cfg.max_tokens, concurrency=cfg.concurrency, rows=rows)


class _Pass(NamedTuple):
    """The answers of one pass, the requests that failed (why), and the pass's wall time."""

    samples: list[Sample]
    errors: list[str]
    wall_s: float


def _measure(setup: Setup, cfg: VLLMBenchConfig, log_dir: Path, reference: dict[str, list[int]],
             on_progress: Callable[[str], None]) -> tuple[list[VLLMRow], dict[str, list[int]]]:
    """One setup, started, measured (steps 2-4 per way in) and stopped; its rows and every answer's token ids by tag.

    Raises:
        ClusterError: the setup did not start.
    """
    rows: list[VLLMRow] = []
    outputs: dict[str, list[int]] = {}
    with started(setup, cfg.model_dir, cfg.redis_url, log_dir, cfg.dispatches, cfg.plain_url) as target, \
            httpx2.Client(timeout=REQUEST_TIMEOUT_S) as client:
        ways = list(target.urls.items())
        if setup.kind == SetupKind.PLAIN:  # the first measured, the others' prompts answered for their reference
            ways = [(d, target.urls[None]) for d in cfg.dispatches] or ways
        for i, (dispatch, url) in enumerate(ways):
            name = f"{setup.name} {dispatch}" if setup.kind == SetupKind.KVWIRE and dispatch == Dispatch.SEQUENTIAL \
                else setup.name
            on_progress(f"{name}: up; {len(cfg.prompt_tokens) * cfg.rounds} sequential requests")
            row, out = _way_in(client, url, _PREFIX[dispatch], name, setup.kind, cfg, target, reference)
            outputs |= out
            if setup.kind != SetupKind.PLAIN or i == 0:
                rows.append(row)
    return rows, outputs


def _way_in(client: httpx2.Client, url: str, prefix: str, name: str, kind: SetupKind, cfg: VLLMBenchConfig,
            target: Target, reference: dict[str, list[int]]) -> tuple[VLLMRow, dict[str, list[int]]]:
    """Steps 2-4 through `url`, every tag opening with `prefix`; the row named `name`, and the answers' tokens."""
    lengths = list(cfg.prompt_tokens)

    def send(asks: list[Ask], concurrency: int) -> _Pass:
        return _send(client, url, str(cfg.model_dir), asks, cfg.max_tokens, concurrency)

    before = _tokens_by_source(target)
    warm = send([Ask(f"{prefix}warm-up-p{i}", n) for i, n in enumerate(lengths)], 1)  # each shape's first forward
    load = ForeignLoad()
    load.start()
    seq = send(sequential_asks(lengths, cfg.rounds, prefix), 1)
    conc = send(concurrent_asks(lengths, cfg.rounds, prefix), cfg.concurrency) if cfg.concurrency else _Pass([], [], 0)
    foreign = load.stop()
    by_source = _since(_tokens_by_source(target), before)
    outputs = {s.tag: s.token_ids for s in seq.samples + conc.samples}
    row = _row(name, kind, (warm, seq, conc), outputs, reference, by_source)
    return msgspec.structs.replace(row, foreign_cores=foreign), outputs


def _since(after: dict[str, float] | None, before: dict[str, float] | None) -> dict[str, float] | None:
    """Counters' growth from `before` to `after` (None if either could not be read)."""
    if after is None or before is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _tokens_by_source(target: Target) -> dict[str, float] | None:
    """The decode server's prompt tokens by source; None for a plain server, or one that does not answer."""
    try:
        return target.tokens_by_source() if target.tokens_by_source else None
    except httpx2.HTTPError:
        return None


def _row(name: str, kind: SetupKind, passes: tuple[_Pass, _Pass, _Pass], outputs: dict[str, list[int]],
         reference: dict[str, list[int]], by_source: dict[str, float] | None) -> VLLMRow:
    warm, seq, conc = passes
    errors = warm.errors + seq.errors + conc.errors
    if not seq.samples:
        return VLLMRow(name, kind, ran=False, reason=f"every request failed: {errors[0]}",
                       errors=len(errors), first_error=errors[0])
    mismatched = sorted(t for t, ids in outputs.items() if reference and ids != reference.get(t))
    pulled = None if by_source is None else by_source.get(_PULLED, 0.0) / max(1.0, sum(by_source.values()))
    ttft, tpot = [s.ttft_ms for s in seq.samples], [s.tpot_ms for s in seq.samples]
    return VLLMRow(
        name, kind, ran=True, requests=len(seq.samples) + len(seq.errors),
        errors=len(errors), first_error=errors[0] if errors else "",
        ttft_ms_p50=quantile(ttft, 0.5), ttft_ms_p90=quantile(ttft, 0.9), tpot_ms_p50=quantile(tpot, 0.5),
        tpot_ms_p90=quantile(tpot, 0.9), latency_ms_p50=quantile([s.latency_ms for s in seq.samples], 0.5),
        concurrent_requests=len(conc.samples) + len(conc.errors),
        throughput_tok_s=round(sum(s.output_tokens for s in conc.samples) / conc.wall_s, 1) if conc.samples else 0.0,
        disaggregated=sum(s.path == ProxyPath.DISAGGREGATED for s in seq.samples + conc.samples),
        kv_pulled=None if pulled is None else round(pulled, 3),
        outputs_equal=None if kind == SetupKind.PLAIN else not mismatched, mismatched=mismatched)


def _send(client: httpx2.Client, url: str, model: str, asks: list[Ask], max_tokens: int, concurrency: int) -> _Pass:
    """Every request of `asks`, `concurrency` at a time (1: one after another, in this thread)."""
    def one(ask: Ask) -> Sample | str:
        try:
            return stream_one(client, url, model, ask, max_tokens)
        except (RequestError, httpx2.HTTPError) as exc:
            return f"{type(exc).__name__}: {exc}"

    start = time.perf_counter()
    if concurrency == 1:
        answers = [one(a) for a in asks]
    else:
        pool = cf.ThreadPoolExecutor(concurrency)
        try:
            answers = list(pool.map(one, asks))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # on Ctrl-C the setup's servers stop at once
    wall_s = time.perf_counter() - start
    return _Pass([a for a in answers if isinstance(a, Sample)], [a for a in answers if isinstance(a, str)], wall_s)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, linearly interpolated between the closest ranks, rounded to 0.01 ms; 0 of no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 2)


def table(result: VLLMBenchResult) -> str:
    head = (f"{'setup':<26} {'reqs':>4} {'errs':>4} {'TTFT p50':>8} {'p90':>7} {'TPOT p50':>8} {'p90':>6} "
            f"{'e2e p50':>7} {'tok/s':>6} {'disagg':>6} {'KV pulled':>9} {'other':>5}  outputs equal")
    lines, notes = [head, "-" * len(head)], []
    for r in result.rows:
        if not r.ran:
            lines.append(f"{r.setup:<26} did not run: {r.reason}")
            continue
        total = r.requests + r.concurrent_requests
        equal = "(baseline)" if r.outputs_equal is None else "yes" if r.outputs_equal else f"NO ({len(r.mismatched)})"
        lines.append(f"{r.setup:<26} {r.requests:>4} {r.errors:>4} {r.ttft_ms_p50:>8.2f} {r.ttft_ms_p90:>7.2f} "
                     f"{r.tpot_ms_p50:>8.2f} {r.tpot_ms_p90:>6.2f} {r.latency_ms_p50:>7.1f} "
                     f"{r.throughput_tok_s or '-':>6} "
                     f"{f'{r.disaggregated}/{total}' if r.kv_pulled is not None else '-':>6} "
                     f"{'-' if r.kv_pulled is None else f'{r.kv_pulled:.0%}':>9} "
                     f"{'-' if r.foreign_cores is None else f'{r.foreign_cores:.2f}':>5}  {equal}")
        if r.errors:
            notes.append(f"{r.setup}: {r.errors} request(s) failed; the first: {r.first_error}")
    lines.append(f"prompts of {', '.join(map(str, result.prompt_tokens))} tokens, {result.max_tokens} output tokens "
                 f"each (greedy); TTFT, TPOT and e2e (request to last token) in ms over {result.rounds} sequential "
                 f"round(s); tok/s: output tokens per second, {result.concurrency} requests at a time; other: cores "
                 f"busy with processes not the bench's while it measured")
    return "\n".join(lines + notes)
