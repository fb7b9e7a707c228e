"""`kvwire bench vllm --workload multiturn`: conversations of several turns plus short single prompts, on one
prefill and two decode vLLM servers (KvwireConnector) behind two routers, and on one plain vLLM server.

Rows, each with prompts of its own (a tag per row opens every prompt, so no row finds another's in a cache):
- ROUND_ROBIN: `kvwire router --routing load --decode-only-below 0`, the router before its scheduler: every
  request disaggregated, decode instances by load, ties in turn;
- SCHEDULER: `kvwire router` with its defaults (router/vllm/schedule.py);
- PLAIN: the plain server alone, which computes every prompt and keeps its own prefix cache.

Lifecycle:
1. STARTED: the four servers side by side (prefill and plain on core 0, both decode servers on core 1: a decode
   server on the prefill server's core stalls UCX pulls past their deadline, see docs/BENCHMARKS.md), then the
   two routers; leaving `bench_multiturn` (Ctrl-C included) stops every process.
2. MEASURED, one row at a time: `concurrency` clients take the conversations and the short prompts in turn, each
   conversation one turn after another (streamed greedy chat, `ignore_eos`), timed at the client; the answer's
   text becomes the conversation's next assistant message. The servers' vllm:prompt_tokens_by_source_total
   before and after the row give the prompt tokens computed (every server's local_compute), transferred (the
   decode servers' external_kv_transfer) and reused (their local_cache_hit).
3. CHECKED: every routed answer's token ids against the plain server's answer to the same messages (asked after
   the row, unmeasured).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import enum
import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx2
import msgspec

from kvwire.bench.vllm.mix import RequestError, make_prompt
from kvwire.bench.vllm.run import quantile
from kvwire.cluster.vllm_cluster import VLLMServer, VLLMServerSpec, start_all
from kvwire.cluster.vllm_pd import DTYPE, counter_by_label, kvwire_pair, start_router
from kvwire.connectors.config import ConnectorKind
from kvwire.router.vllm.prefill import DECODE_HEADER, PATH_HEADER

REQUEST_TIMEOUT_S = 120.0
_SOURCES = "vllm:prompt_tokens_by_source_total"


class Row(enum.StrEnum):
    ROUND_ROBIN = "round-robin, always disaggregated"
    SCHEDULER = "kvwire scheduler (defaults)"
    PLAIN = "plain vLLM"


ROUTER_ARGS = {Row.ROUND_ROBIN: ("--routing", "load", "--decode-only-below", "0"), Row.SCHEDULER: ()}


@dataclass(frozen=True)
class MultiturnConfig:
    model_dir: Path
    redis_url: str
    log_dir: Path
    transport: ConnectorKind = ConnectorKind.UCX
    conversations: int = 6
    turns: int = 4
    system_tokens: int = 700  # a conversation's first prompt: longer than the scheduler's 512-token threshold
    user_tokens: int = 60
    shorts: int = 6  # single prompts of short_tokens
    short_tokens: int = 120
    max_tokens: int = 32
    concurrency: int = 3


class TurnSample(msgspec.Struct, frozen=True):
    tag: str  # conversation and turn: "c2-t1"; "s3" for a short prompt
    ttft_ms: float
    output_tokens: int
    token_ids: list[int]
    path: str  # x-kvwire-path ("" from the plain server)
    decode: str  # x-kvwire-decode


class MultiturnRow(msgspec.Struct, frozen=True):
    setup: str
    requests: int
    errors: int
    first_error: str
    ttft_ms_p50: float
    ttft_ms_p90: float
    output_tok_s: float  # output tokens of the row over its wall time
    prompt_tokens: float  # as the servers that answered counted them
    computed: float  # share of them some server computed (prefill and decode servers together)
    transferred: float  # share whose KV a connector moved to a decode server
    reused: float  # share a decode (or the plain) server found in its own prefix cache
    decode_only: int  # answers the router sent decode-only
    stayed: float | None  # share of later turns answered by their conversation's first decode server
    outputs_equal: bool | None  # against the plain server's; None for the plain row
    mismatched: list[str] = []


class Servers(NamedTuple):
    plain: VLLMServer
    prefill: VLLMServer
    decodes: list[VLLMServer]
    routers: dict[Row, str]


def bench_multiturn(cfg: MultiturnConfig, on_progress: Callable[[str], None] = lambda _: None) -> list[MultiturnRow]:
    """Every row of the module docstring in turn, on one set of servers."""
    with _started(cfg, on_progress) as servers:
        rows = []
        for row in Row:
            on_progress(f"{row}: measuring")
            rows.append(_measure(row, servers, cfg))
        return rows


@contextmanager
def _started(cfg: MultiturnConfig, on_progress: Callable[[str], None]) -> Iterator[Servers]:
    on_progress(f"starting 4 vLLM servers and 2 routers (logs in {cfg.log_dir})")
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    prefill, decode = kvwire_pair(cfg.model_dir, cfg.redis_url, cfg.transport, cfg.log_dir)
    decode2 = dataclasses.replace(decode, node_id=f"decode2-{cfg.transport}", log_path=cfg.log_dir / "decode2.log")
    plain = VLLMServerSpec(cfg.model_dir, cpu_cores="0", dtype=DTYPE, log_path=cfg.log_dir / "plain.log")
    with ExitStack() as stack:
        servers = start_all([plain, prefill, decode, decode2])
        for server in servers:
            stack.callback(server.stop)
        routers = {}
        for row, args in ROUTER_ARGS.items():
            url, proc = start_router([servers[1].url], [s.url for s in servers[2:]],
                                     cfg.log_dir / f"router-{row.name.lower()}.log", args)
            stack.callback(proc.wait, 10)
            stack.callback(proc.terminate)
            routers[row] = url
        yield Servers(servers[0], servers[1], servers[2:], routers)


def _measure(row: Row, servers: Servers, cfg: MultiturnConfig) -> MultiturnRow:
    url = servers.plain.url if row == Row.PLAIN else servers.routers[row]
    counted = [servers.plain] if row == Row.PLAIN else [servers.prefill, *servers.decodes]
    before = [counter_by_label(s.url, _SOURCES, "source") for s in counted]
    scripts = _scripts(row, cfg)
    started = time.perf_counter()
    with httpx2.Client(timeout=REQUEST_TIMEOUT_S) as client, cf.ThreadPoolExecutor(cfg.concurrency) as pool:
        done = list(pool.map(lambda script: _run_script(client, url, str(cfg.model_dir), script, cfg.max_tokens),
                             scripts))
    wall_s = time.perf_counter() - started
    after = [counter_by_label(s.url, _SOURCES, "source") for s in counted]
    samples = [s for ran in done for s in ran.samples]
    errors = [ran.error for ran in done if ran.error]
    mismatched = [] if row == Row.PLAIN else _mismatched(servers.plain.url, cfg, done, scripts)
    sources = _delta(before, after, counted, servers)
    ttfts = [s.ttft_ms for s in samples]
    total = sources["prompt"] or 1.0
    return MultiturnRow(
        setup=str(row), requests=len(samples) + len(errors), errors=len(errors),
        first_error=errors[0] if errors else "", ttft_ms_p50=quantile(ttfts, 0.5), ttft_ms_p90=quantile(ttfts, 0.9),
        output_tok_s=round(sum(s.output_tokens for s in samples) / wall_s, 1), prompt_tokens=sources["prompt"],
        computed=round(sources["computed"] / total, 3), transferred=round(sources["transferred"] / total, 3),
        reused=round(sources["reused"] / total, 3), decode_only=sum(s.path == "decode-only" for s in samples),
        stayed=None if row == Row.PLAIN else _stayed(samples), outputs_equal=None if row == Row.PLAIN else
        not mismatched and not errors, mismatched=mismatched)


class Script(NamedTuple):
    """One client's work: a conversation (a system prompt and its user turns) or one short prompt."""

    tag: str
    system: str | None
    users: list[str]


def _scripts(row: Row, cfg: MultiturnConfig) -> list[Script]:
    prefix = {Row.ROUND_ROBIN: "rr", Row.SCHEDULER: "ks", Row.PLAIN: "pl"}[row]
    talks = [Script(f"{prefix}-c{i}", make_prompt(f"{prefix}-c{i}", cfg.system_tokens),
                    [make_prompt(f"{prefix}-c{i}-u{t}", cfg.user_tokens) for t in range(cfg.turns)])
             for i in range(cfg.conversations)]
    shorts = [Script(f"{prefix}-s{i}", None, [make_prompt(f"{prefix}-s{i}", cfg.short_tokens)])
              for i in range(cfg.shorts)]
    out: list[Script] = []
    for i in range(max(len(talks), len(shorts))):  # a short prompt between conversations
        out += talks[i:i + 1] + shorts[i:i + 1]
    return out


def _messages(script: Script, answers: list[str], turn: int) -> list[dict[str, str]]:
    """The messages of `script`'s turn `turn`, after the answers given to its earlier turns."""
    out = [{"role": "system", "content": script.system}] if script.system else []
    for t in range(turn + 1):
        out.append({"role": "user", "content": script.users[t]})
        if t < turn:
            out.append({"role": "assistant", "content": answers[t]})
    return out


class Ran(NamedTuple):
    """What one script gave: a sample and the answer's text per turn answered, and the error that ended it."""

    samples: list[TurnSample]
    answers: list[str]
    error: str


def _run_script(client: httpx2.Client, url: str, model: str, script: Script, max_tokens: int) -> Ran:
    """Every turn of `script` in order, each answer's text the next turn's assistant message; an error ends it."""
    ran = Ran([], [], "")
    for turn in range(len(script.users)):
        tag = f"{script.tag}-t{turn}"
        try:
            sample, text = _stream_chat(client, url, model, tag, _messages(script, ran.answers, turn), max_tokens)
        except (RequestError, httpx2.HTTPError) as exc:
            return ran._replace(error=f"{tag}: {exc}")
        ran.samples.append(sample)
        ran.answers.append(text)
    return ran


def _chat_body(model: str, messages: list[dict[str, str]], max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


def _stream_chat(client: httpx2.Client, url: str, model: str, tag: str, messages: list[dict[str, str]],
                 max_tokens: int) -> tuple[TurnSample, str]:
    first, text, usage = 0.0, "", None
    ids: list[int] = []
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=_chat_body(model, messages, max_tokens,
                                                                              True)) as resp:
        if resp.status_code != 200:
            raise RequestError(tag, url, f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        headers = resp.headers
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                first = first or time.perf_counter()
                ids += chunk["choices"][0].get("token_ids") or []
                text += chunk["choices"][0].get("delta", {}).get("content") or ""
            usage = chunk.get("usage") or usage
    if not first or usage is None:
        raise RequestError(tag, url, "the stream ended without tokens or without its usage chunk")
    return TurnSample(tag, (first - start) * 1e3, int(usage["completion_tokens"]), ids,
                      headers.get(PATH_HEADER, ""), headers.get(DECODE_HEADER, "")), text


def _mismatched(plain_url: str, cfg: MultiturnConfig, done: list[Ran], scripts: list[Script]) -> list[str]:
    """Tags of the routed answers whose token ids differ from the plain server's for the same messages."""
    out = []
    with httpx2.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for script, ran in zip(scripts, done):
            for turn, sample in enumerate(ran.samples):
                body = _chat_body(str(cfg.model_dir), _messages(script, ran.answers, turn), cfg.max_tokens, False)
                got = client.post(f"{plain_url}/v1/chat/completions", json=body).json()
                if got["choices"][0].get("token_ids") != sample.token_ids:
                    out.append(sample.tag)
    return out


def _delta(before: list[dict[str, float]], after: list[dict[str, float]], counted: list[VLLMServer],
           servers: Servers) -> dict[str, float]:
    """Prompt tokens by what happened to them over a row: computed anywhere, transferred, reused on decode."""
    diff = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a} for b, a in zip(before, after)]
    answering = [d for d, s in zip(diff, counted) if s is not servers.prefill]  # decode servers, or the plain one
    transferred = sum(d.get("external_kv_transfer", 0.0) for d in answering)
    reused = sum(d.get("local_cache_hit", 0.0) for d in answering)
    computed_there = sum(d.get("local_compute", 0.0) for d in answering)
    computed = sum(d.get("local_compute", 0.0) for d in diff)
    return {"prompt": transferred + reused + computed_there, "computed": computed, "transferred": transferred,
            "reused": reused}


def _stayed(samples: list[TurnSample]) -> float | None:
    first: dict[str, str] = {}
    later = []
    for s in samples:
        talk, _, turn = s.tag.rpartition("-t")
        if turn == "0":
            first[talk] = s.decode
        else:
            later.append(s.decode == first.get(talk))
    return round(sum(later) / len(later), 3) if later else None


def table(rows: list[MultiturnRow]) -> str:
    head = ("| setup | requests | errors | TTFT p50 ms | TTFT p90 ms | output tok/s | computed | transferred | "
            "reused | decode-only | later turns on their decode server | outputs equal |")
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        lines.append(f"| {r.setup} | {r.requests} | {r.errors} | {r.ttft_ms_p50} | {r.ttft_ms_p90} | "
                     f"{r.output_tok_s} | {r.computed:.1%} | {r.transferred:.1%} | {r.reused:.1%} | {r.decode_only} | "
                     f"{'' if r.stayed is None else f'{r.stayed:.0%}'} | "
                     f"{'' if r.outputs_equal is None else r.outputs_equal} |")
    return "\n".join(lines)
