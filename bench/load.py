"""`kvwire bench load`: many requests from many concurrent clients through the router.

Lifecycle:

1. Tokenize a deterministic prompt mix (the demo's prompts plus seeded random ASCII
   prompts of varied lengths) and compute every prompt's greedy output in one process
   (the reference).
2. Start a local cluster (private Redis, prefill, decode, router; real processes).
3. Warm up: send every distinct prompt once at full concurrency, wait until the cluster
   is idle and note each process's RSS.
4. Send `requests` requests from `concurrency` clients, each request's outcome checked
   against the reference.
5. Wait (with a deadline) until both KV pools are full again and the directory holds no
   request entry, and note each process's RSS again.

The result passes when nothing was lost, errored or mismatched and memory came back.
"""

from __future__ import annotations

import asyncio
import enum
import random
import string
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvwire.bench.prompts import PROMPTS
from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from kvwire.observability.labels import BlockState
from kvwire.protocol.work import SamplingParams

_MIB = 1024 * 1024
_ASCII = string.ascii_letters + string.digits + string.punctuation + " "
_PROCESSES = ("prefill", "decode", "router")
_TOMBSTONES = frozenset({TransferState.FAILED, TransferState.EXPIRED})


@dataclass(frozen=True)
class LoadConfig:
    """Everything one `bench load` run needs.

    Attributes:
        model_dir: the checkpoint every process serves.
        connector: the transport between prefill and decode.
        requests: requests sent in the measured phase.
        concurrency: clients sending at once, each one request at a time.
        max_tokens: tokens generated per request (greedy).
        distinct_prompts: size of the prompt mix (the demo's prompts come first).
        max_prompt_chars: longest random prompt.
        seed: seeds the random prompts and the order requests use them in.
        num_blocks: KV blocks of each node's pool.
        kv_deadline_s: the nodes' --kv-deadline: KV later than this is recomputed on decode.
        rss_tolerance_mib: allowed RSS growth of each process from after warm-up to after the load.
        cleanup_timeout_s: how long the pools may take to fill and live directory entries to go
            after the load (tombstones get their TTL on top, see `wait_idle`).
        request_timeout_s: a client gives up on a request (counted lost) after this long.
    """

    model_dir: Path
    connector: ConnectorKind = ConnectorKind.AUTO
    requests: int = 1000
    concurrency: int = 64
    max_tokens: int = 8
    distinct_prompts: int = 64
    max_prompt_chars: int = 600
    seed: int = 0
    num_blocks: int = 1024
    kv_deadline_s: float = 10.0
    rss_tolerance_mib: float = 64.0
    cleanup_timeout_s: float = 30.0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if min(self.requests, self.concurrency, self.max_tokens, self.max_prompt_chars) < 1:
            raise ValueError("requests, concurrency, max_tokens and max_prompt_chars must be positive")
        if self.distinct_prompts < len(PROMPTS):
            raise ValueError(f"distinct_prompts must be at least {len(PROMPTS)} (the demo's prompts)")


class Outcome(enum.StrEnum):
    OK = "ok"  # HTTP 200, tokens equal to the reference
    MISMATCH = "mismatch"  # HTTP 200, tokens differ
    ERROR = "error"  # an HTTP status other than 200
    LOST = "lost"  # no HTTP response at all (timeout, connection dropped)


class PoolState(msgspec.Struct, frozen=True):
    node: NodeRole
    total: int
    free: int
    used: int


class ProcessMemory(msgspec.Struct, frozen=True):
    process: str  # prefill, decode or router
    rss_warm_mib: float  # after the warm-up, cluster idle
    rss_after_mib: float  # after the load, cluster idle
    growth_mib: float


class Drained(msgspec.Struct, frozen=True):
    """What the cluster holds once the load is over."""

    pools: list[PoolState]  # once both were full and no live entry was left, or at the deadline
    live_entries: list[str]  # PENDING / READY entries then: KV nobody will ever pull
    tombstones: int  # FAILED / EXPIRED entries then; they vanish with their TTL
    entries_left: list[str]  # after waiting out the tombstones' TTL
    empty_after_s: float  # from the end of the load until the directory held no request entry


class LoadResult(msgspec.Struct, frozen=True):
    connector: ConnectorKind
    concurrency: int
    sent: int
    ok: int
    errors: int
    lost: int
    mismatched: int
    bypassed: int  # ok or mismatched responses whose KV was transferred (prompt forward skipped)
    transfer_failures: int  # pulls the decode node gave up on (KV late or failed); each recomputes its batch
    elapsed_s: float
    throughput_rps: float  # answered requests per second
    throughput_tok_s: float  # output tokens per second
    ttft_ms_p50: float  # at the router (kvwire.ttft_ms)
    ttft_ms_p99: float
    latency_ms_p50: float  # end to end, at the client
    latency_ms_p99: float
    error_samples: list[str]  # a few distinct error / loss messages
    pools: list[PoolState]
    pools_full: bool
    directory: Drained
    memory: list[ProcessMemory]
    rss_tolerance_mib: float
    memory_returned: bool  # pools full, no live entry, directory empty, every RSS within tolerance
    passed: bool


class _Sample(msgspec.Struct):
    outcome: Outcome
    latency_ms: float
    ttft_ms: float = 0.0
    tokens: int = 0
    bypassed: bool = False
    detail: str = ""


@dataclass(frozen=True)
class _Workload:
    prompts: list[str]
    expected: list[list[int]]  # the reference output of each prompt
    order: list[int]  # request i sends prompts[order[i]]


def prompt_mix(cfg: LoadConfig) -> list[str]:
    """The demo's prompts, then seeded random printable-ASCII prompts of 1..max_prompt_chars characters."""
    rng = random.Random(cfg.seed)
    extra = [
        "".join(rng.choices(_ASCII, k=rng.randint(1, cfg.max_prompt_chars)))
        for _ in range(cfg.distinct_prompts - len(PROMPTS))
    ]
    return PROMPTS + extra


def build_workload(cfg: LoadConfig) -> _Workload:
    """The prompt mix, its single-process reference outputs, and a seeded order of `requests` uses of it."""
    from kvwire.engine.reference import generate
    from kvwire.engine.tokenizer import load_tokenizer

    prompts = prompt_mix(cfg)
    tokenizer = load_tokenizer(cfg.model_dir)
    ids = [tokenizer.encode(p) for p in prompts]
    # A pool that holds every prompt at once, so the reference never has to wait for blocks.
    blocks = sum(-(-(len(p) + cfg.max_tokens) // 16) for p in ids) + 64
    expected = generate(cfg.model_dir, ids, _params(cfg), num_blocks=max(1024, blocks))
    order = [i % len(prompts) for i in range(cfg.requests)]
    random.Random(cfg.seed + 1).shuffle(order)
    return _Workload(prompts, expected, order)


def _params(cfg: LoadConfig) -> SamplingParams:
    return SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)


async def _send(client: httpx2.AsyncClient, url: str, prompt: str, expected: list[int], cfg: LoadConfig) -> _Sample:
    body = {"prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": 0.0, "return_token_ids": True}
    start = time.perf_counter()
    try:
        resp = await client.post(f"{url}/v1/completions", json=body)
    except httpx2.HTTPError as exc:
        return _Sample(Outcome.LOST, _ms_since(start), detail=f"{type(exc).__name__}: {exc}")
    latency = _ms_since(start)
    if resp.status_code != 200:
        return _Sample(Outcome.ERROR, latency, detail=f"HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json()
    tokens, k = data["choices"][0]["token_ids"], data["kvwire"]
    outcome = Outcome.OK if tokens == expected else Outcome.MISMATCH
    return _Sample(outcome, latency, k["ttft_ms"] or 0.0, len(tokens), bool(k["bypassed"]),
                   "" if outcome is Outcome.OK else f"got {tokens}, expected {expected}")


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


async def _drive(url: str, work: _Workload, order: list[int], cfg: LoadConfig) -> tuple[list[_Sample], float]:
    """Send prompts[order[i]] for every i from `concurrency` clients; return the samples and elapsed seconds."""
    samples: list[_Sample | None] = [None] * len(order)
    next_index = iter(range(len(order)))  # shared by the clients: one event loop, no lock needed
    limits = httpx2.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)

    async def client_loop(client: httpx2.AsyncClient) -> None:
        for i in next_index:
            p = order[i]
            samples[i] = await _send(client, url, work.prompts[p], work.expected[p], cfg)

    start = time.perf_counter()
    async with httpx2.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(cfg.concurrency)))
    return [s for s in samples if s is not None], time.perf_counter() - start


def scrape_samples(url: str, name: str) -> dict[str, float]:
    """{label values joined by ",": value} of one metric in a process's /metrics."""
    text = httpx2.get(f"{url}/metrics", timeout=10.0).raise_for_status().text
    return {",".join(s.labels.values()): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def scrape_pool(url: str, node: NodeRole, total: int) -> PoolState:
    """The node's kvwire_kv_blocks{state} from its /metrics."""
    blocks = scrape_samples(url, "kvwire_kv_blocks")
    return PoolState(node, total, int(blocks[BlockState.FREE]), int(blocks[BlockState.USED]))


def _transfer_failures(cluster: LocalCluster) -> int:
    """The decode node's kvwire_kv_transfers_failed_total, every reason."""
    return int(sum(scrape_samples(cluster.ops_urls[NodeRole.DECODE], "kvwire_kv_transfers_failed_total").values()))


def _pools(cluster: LocalCluster, total: int) -> list[PoolState]:
    return [scrape_pool(cluster.ops_urls[role], role, total) for role in (NodeRole.PREFILL, NodeRole.DECODE)]


def wait_idle(cluster: LocalCluster, cfg: LoadConfig, *, tombstones_too: bool = True) -> Drained:
    """Poll (each wait with a deadline) until both pools are full and no live entry is left, then,
    with `tombstones_too`, until the directory holds no request entry at all.

    FAILED / EXPIRED entries are tombstones that tell a late producer or consumer to give up: nobody
    deletes them, they expire with the entry TTL (max(60 s, 2 x KV deadline), cli/options.py).
    """
    directory, start = KVDirectory(cluster.redis_url), time.monotonic()
    try:
        while True:
            pools, entries = _pools(cluster, cfg.num_blocks), directory.entries_with_age()
            live = [a.entry.request_id for a in entries if a.entry.state not in _TOMBSTONES]
            if (_full(pools) and not live) or time.monotonic() > start + cfg.cleanup_timeout_s:
                break
            time.sleep(0.2)
        left = [a.entry.request_id for a in entries]
        ttl_deadline = time.monotonic() + max(60.0, 2 * cfg.kv_deadline_s) + 10.0
        while tombstones_too and left and time.monotonic() < ttl_deadline:
            time.sleep(0.5)
            left = directory.request_ids()
    finally:
        directory.close()
    return Drained(pools, live, len(entries) - len(live), left, round(time.monotonic() - start, 1))


def _full(pools: list[PoolState]) -> bool:
    return all(p.free == p.total and p.used == 0 for p in pools)


def rss_mib(pid: int) -> float:
    """VmRSS of a process, in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _rss_all(cluster: LocalCluster) -> dict[str, float]:
    return {name: rss_mib(cluster.procs[name].pid) for name in _PROCESSES}


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    ordered = sorted(values)
    return round(ordered[round(q * (len(ordered) - 1))], 2) if ordered else 0.0


def summarize(cfg: LoadConfig, samples: list[_Sample], elapsed: float, drained: Drained,
              memory: list[ProcessMemory], transfer_failures: int = 0) -> LoadResult:
    """Fold the samples and the post-load checks into one LoadResult."""
    count = {o: sum(s.outcome is o for s in samples) for o in Outcome}
    answered = [s for s in samples if s.outcome in (Outcome.OK, Outcome.MISMATCH)]
    pools_full = _full(drained.pools)
    memory_ok = (pools_full and not drained.live_entries and not drained.entries_left
                 and all(m.growth_mib <= cfg.rss_tolerance_mib for m in memory))
    clean = count[Outcome.ERROR] == count[Outcome.LOST] == count[Outcome.MISMATCH] == 0
    return LoadResult(
        connector=cfg.connector, concurrency=cfg.concurrency, sent=len(samples), ok=count[Outcome.OK],
        errors=count[Outcome.ERROR], lost=count[Outcome.LOST], mismatched=count[Outcome.MISMATCH],
        bypassed=sum(s.bypassed for s in answered), transfer_failures=transfer_failures,
        elapsed_s=round(elapsed, 2), throughput_rps=round(len(answered) / elapsed, 2),
        throughput_tok_s=round(sum(s.tokens for s in answered) / elapsed, 1),
        ttft_ms_p50=_pct([s.ttft_ms for s in answered], 0.5), ttft_ms_p99=_pct([s.ttft_ms for s in answered], 0.99),
        latency_ms_p50=_pct([s.latency_ms for s in answered], 0.5),
        latency_ms_p99=_pct([s.latency_ms for s in answered], 0.99),
        error_samples=sorted({s.detail for s in samples if s.detail})[:5], pools=drained.pools,
        pools_full=pools_full, directory=drained, memory=memory, rss_tolerance_mib=cfg.rss_tolerance_mib,
        memory_returned=memory_ok, passed=clean and memory_ok and len(samples) == cfg.requests)


def bench_load(cfg: LoadConfig) -> LoadResult:
    """Run the whole benchmark (see the module docstring).

    Raises:
        ClusterError: the local cluster did not start.
    """
    work = build_workload(cfg)
    spec = ClusterSpec(model_dir=cfg.model_dir, connector=cfg.connector, num_blocks=cfg.num_blocks,
                       kv_deadline_s=cfg.kv_deadline_s, log_level="ERROR")
    with LocalCluster(spec) as cluster:
        asyncio.run(_drive(cluster.url, work, list(range(len(work.prompts))), cfg))  # warm-up
        wait_idle(cluster, cfg, tombstones_too=False)
        warm, failed_before = _rss_all(cluster), _transfer_failures(cluster)
        samples, elapsed = asyncio.run(_drive(cluster.url, work, work.order, cfg))
        drained = wait_idle(cluster, cfg)
        after, failed = _rss_all(cluster), _transfer_failures(cluster) - failed_before
    memory = [ProcessMemory(n, round(warm[n], 1), round(after[n], 1), round(after[n] - warm[n], 1))
              for n in _PROCESSES]
    return summarize(cfg, samples, elapsed, drained, memory, failed)


def table(result: LoadResult) -> str:
    """The result as a few human-readable lines."""
    r = result
    lines = [
        f"{r.sent} requests from {r.concurrency} clients over {r.connector} in {r.elapsed_s:.1f} s: "
        f"{r.throughput_rps:.2f} req/s, {r.throughput_tok_s:.1f} output tok/s",
        f"{'sent':>6} {'ok':>6} {'errors':>6} {'lost':>6} {'mismatch':>8} {'bypassed':>8} {'xfer failed':>11}",
        f"{r.sent:>6} {r.ok:>6} {r.errors:>6} {r.lost:>6} {r.mismatched:>8} {r.bypassed:>8} "
        f"{r.transfer_failures:>11}",
        f"TTFT (router) p50 {r.ttft_ms_p50:.1f} ms, p99 {r.ttft_ms_p99:.1f} ms; "
        f"end-to-end latency p50 {r.latency_ms_p50:.1f} ms, p99 {r.latency_ms_p99:.1f} ms",
        f"{'pool':<8} {'total':>6} {'free':>6} {'used':>6}",
        *(f"{p.node:<8} {p.total:>6} {p.free:>6} {p.used:>6}" for p in r.pools),
        f"directory after the load: {len(r.directory.live_entries)} live entries, {r.directory.tombstones} "
        f"failed/expired (TTL); {len(r.directory.entries_left)} left after {r.directory.empty_after_s:.0f} s",
        f"{'process':<8} {'RSS warm MiB':>12} {'after MiB':>10} {'growth':>8}  "
        f"(tolerance +{r.rss_tolerance_mib:.0f} MiB)",
        *(f"{m.process:<8} {m.rss_warm_mib:>12.1f} {m.rss_after_mib:>10.1f} {m.growth_mib:>+8.1f}" for m in r.memory),
        f"memory returned: {'yes' if r.memory_returned else 'NO'}; passed: {'yes' if r.passed else 'NO'}",
    ]
    lines += [f"  e.g. {d}" for d in r.error_samples]
    return "\n".join(lines)
