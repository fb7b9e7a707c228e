"""`kvwire bench e2e`: the same prompt mix through the router, disaggregated and single-node.

Lifecycle:

1. Start a local cluster (private Redis, prefill, decode, router; real processes).
2. Send the mix one request at a time for `rounds` rounds (TTFT and time per output
   token), each prompt twice in a row: disaggregated (prefill node computes, decode node
   receives the KV) and single-node (`"disaggregate": false`: the same decode process
   computes the prompt itself), the order alternating between rounds, so the machine's
   drift weighs on both modes alike.
3. Send all of the mix at once in each mode (throughput).
4. Unless `bare` is off, send the same sequential requests through the bare chain (bench/bare_chain.py:
   the same engine in two processes, no kvwire), whose TTFT gap is what disaggregating costs on this
   host before kvwire does anything; what kvwire adds is the cluster's gap less that one.

Every output is checked equal across the two modes.
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import time
from pathlib import Path

import httpx2
import msgspec

from kvwire.bench.load import scrape_samples
from kvwire.bench.prompts import PROMPTS
from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind, NodeRole

MODES = ("disaggregated", "single-node")
GAP_SLACK_MS = 1.0  # the TTFT gap may exceed the median transfer by this much (issue 19; was 2 ms)


class ModeResult(msgspec.Struct, frozen=True):
    mode: str  # disaggregated or single-node
    requests: int
    ttft_ms_p50: float  # at the router, sequential requests
    ttft_ms_p99: float
    tpot_ms_p50: float  # time per output token after the first, at the client
    throughput_rps: float  # all prompts at once
    throughput_tok_s: float
    transfer_ms_p50: float  # 0 in single-node mode
    bypassed: int  # requests whose prompt forward the decode node skipped


class E2EResult(msgspec.Struct, frozen=True):
    modes: list[ModeResult]
    ttft_gap_ms_p50: float  # median over prompts of (disaggregated - single-node) median TTFT
    allowed_gap_ms: float  # median transfer time + GAP_SLACK_MS
    outputs_equal: bool
    # mean prompt forward over the sequential requests (kvwire_prompt_forward_seconds): the same
    # prompts, computed by the prefill node (disaggregated) and by the decode node (single-node)
    forward_ms_prefill_node: float
    forward_ms_decode_node: float
    # means over the same sequential requests, so that the forward's difference can be taken out of the gap
    ttft_gap_ms_mean: float = 0.0  # mean disaggregated TTFT - mean single-node TTFT
    transfer_ms_mean: float = 0.0
    # the bare chain's TTFT gap, median over prompts as ttft_gap_ms_p50 (None: not measured)
    bare_gap_ms_p50: float | None = None

    @property
    def kvwire_gap_ms(self) -> float | None:
        """The cluster's TTFT gap less the bare chain's: what kvwire adds to disaggregating."""
        return None if self.bare_gap_ms_p50 is None else round(self.ttft_gap_ms_p50 - self.bare_gap_ms_p50, 2)

    @property
    def forward_gap_ms(self) -> float:
        """The mean prompt forward's difference between the two nodes (prefill node - decode node)."""
        return round(self.forward_ms_prefill_node - self.forward_ms_decode_node, 3)

    @property
    def gap_beside_forward_ms(self) -> float:
        """The mean TTFT gap less the mean prompt forward's difference between the two nodes."""
        return round(self.ttft_gap_ms_mean - self.forward_gap_ms, 2)


class _Sample(msgspec.Struct):
    prompt: int
    ttft_ms: float
    tpot_ms: float
    transfer_ms: float
    bypassed: bool
    tokens: list[int]


def _ask(client: httpx2.Client, url: str, i: int, max_tokens: int, mode: str) -> _Sample:
    start = time.perf_counter()
    resp = client.post(f"{url}/v1/completions", json={
        "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True,
        "disaggregate": mode == MODES[0]})
    total_ms = (time.perf_counter() - start) * 1e3
    resp.raise_for_status()
    data = resp.json()
    k, tokens = data["kvwire"], data["choices"][0]["token_ids"]
    if k.get("cached_tokens"):  # a node started with its prefix cache on: the modes would not compare
        raise RuntimeError(f"prompt {i} ({mode}): the decode node held {k['cached_tokens']} of its tokens in its "
                           "prefix cache; bench e2e compares whole prompts (decode nodes with --no-prefix-cache)")
    tpot = (total_ms - k["ttft_ms"]) / max(1, len(tokens) - 1)
    return _Sample(i, k["ttft_ms"], tpot, k.get("transfer_ms") or 0.0, bool(k["bypassed"]), tokens)


def _sequential(client: httpx2.Client, url: str, rounds: int, max_tokens: int) -> dict[str, list[_Sample]]:
    out: dict[str, list[_Sample]] = {m: [] for m in MODES}
    for r in range(rounds):
        for i in range(len(PROMPTS)):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                out[mode].append(_ask(client, url, i, max_tokens, mode))
    return out


def _burst(client: httpx2.Client, url: str, max_tokens: int, mode: str) -> tuple[list[_Sample], float]:
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        burst = list(pool.map(lambda i: _ask(client, url, i, max_tokens, mode), range(len(PROMPTS))))
    return burst, time.perf_counter() - start


def _mode_result(mode: str, samples: list[_Sample], burst: list[_Sample], elapsed: float) -> ModeResult:
    ttft = sorted(s.ttft_ms for s in samples)
    return ModeResult(
        mode=mode, requests=len(samples) + len(burst), ttft_ms_p50=round(statistics.median(ttft), 2),
        ttft_ms_p99=round(ttft[int(0.99 * (len(ttft) - 1))], 2),
        tpot_ms_p50=round(statistics.median(s.tpot_ms for s in samples), 3),
        throughput_rps=round(len(burst) / elapsed, 2),
        throughput_tok_s=round(sum(len(s.tokens) for s in burst) / elapsed, 1),
        transfer_ms_p50=round(statistics.median(s.transfer_ms for s in samples), 2),
        bypassed=sum(s.bypassed for s in samples + burst))


def _forward_totals(cluster: LocalCluster) -> dict[NodeRole, tuple[float, float]]:
    """Each node's kvwire_prompt_forward_seconds (sum, count)."""
    out = {}
    for role in (NodeRole.PREFILL, NodeRole.DECODE):
        url = cluster.ops_urls[role]
        out[role] = (scrape_samples(url, "kvwire_prompt_forward_seconds_sum").get("", 0.0),
                     scrape_samples(url, "kvwire_prompt_forward_seconds_count").get("", 0.0))
    return out


def _mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    n = after[1] - before[1]
    return round((after[0] - before[0]) / n * 1e3, 3) if n else 0.0


def _per_prompt_median_ttft(samples: list[_Sample]) -> list[float]:
    return [statistics.median(s.ttft_ms for s in samples if s.prompt == i) for i in range(len(PROMPTS))]


def _bare_gap_ms(model_dir: Path, rounds: int, max_tokens: int) -> float:
    """The bare chain's TTFT gap: median over prompts of (disaggregated - single-node) median TTFT."""
    from kvwire.bench.bare_chain import BareChain
    from kvwire.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p) or [0] for p in PROMPTS]
    blocks = 2 * (max(map(len, prompts)) + max_tokens) // 16 + 8
    ttft: dict[tuple[int, str], list[float]] = {(i, m): [] for i in range(len(prompts)) for m in MODES}
    with BareChain(model_dir, blocks) as chain:
        for r in range(rounds + 1):  # the first round warms up
            for i, prompt in enumerate(prompts):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    ms, _ = chain.ask(prompt, max_tokens, mode == MODES[0])
                    if r:
                        ttft[i, mode].append(ms)
    return round(statistics.median(statistics.median(ttft[i, MODES[0]]) - statistics.median(ttft[i, MODES[1]])
                                   for i in range(len(prompts))), 2)


def bench_e2e(model_dir: Path, connector: ConnectorKind, rounds: int, max_tokens: int,
              layerwise: bool = False, bare: bool = True) -> E2EResult:
    # no prefix cache on either node: each prompt is asked in both modes, and single-node would find it cached (the
    # blocks the disaggregated run received, or an earlier round computed) and compute only its tail
    spec = ClusterSpec(model_dir=model_dir, connector=connector, log_level="ERROR", layerwise=layerwise,
                       prefix_cache=False)
    with LocalCluster(spec) as cluster, httpx2.Client(timeout=120.0) as client:
        _sequential(client, cluster.url, 1, max_tokens)  # warm-up
        before = _forward_totals(cluster)
        samples = _sequential(client, cluster.url, rounds, max_tokens)
        after = _forward_totals(cluster)
        bursts = {mode: _burst(client, cluster.url, max_tokens, mode) for mode in MODES}
    results = [_mode_result(m, samples[m], *bursts[m]) for m in MODES]
    d_samples, s_samples = samples[MODES[0]] + bursts[MODES[0]][0], samples[MODES[1]] + bursts[MODES[1]][0]
    gaps = [d - s for d, s in zip(_per_prompt_median_ttft(samples[MODES[0]]),
                                  _per_prompt_median_ttft(samples[MODES[1]]))]
    by_prompt = {s.prompt: s.tokens for s in s_samples}
    mean_ttft = {m: statistics.mean(s.ttft_ms for s in samples[m]) for m in MODES}
    return E2EResult(modes=results, ttft_gap_ms_p50=round(statistics.median(gaps), 2),
                     allowed_gap_ms=round(results[0].transfer_ms_p50 + GAP_SLACK_MS, 2),
                     outputs_equal=all(s.tokens == by_prompt[s.prompt] for s in d_samples + s_samples),
                     forward_ms_prefill_node=_mean_ms(before[NodeRole.PREFILL], after[NodeRole.PREFILL]),
                     forward_ms_decode_node=_mean_ms(before[NodeRole.DECODE], after[NodeRole.DECODE]),
                     ttft_gap_ms_mean=round(mean_ttft[MODES[0]] - mean_ttft[MODES[1]], 2),
                     transfer_ms_mean=round(statistics.mean(s.transfer_ms for s in samples[MODES[0]]), 2),
                     bare_gap_ms_p50=_bare_gap_ms(model_dir, rounds, max_tokens) if bare else None)
