"""Tensor- and data-parallel vLLM servers with KvwireConnector, against one plain vLLM server.

The minimal connector config (no node_id) on every server, the kvwire router in front, the official
`openai` client: a TP=2 prefill server feeding a TP=1 decode server, the reverse, and a prefill server of two
data-parallel engines (each its own node; the API server spreads the requests over them), which then decodes
requests of n > 1 choices, each pulled once. Each decode rank
pulls its KV heads from the prefill ranks that hold them (connectors/vllm/tp.py); the answers equal the
plain server's and the decode server computes no prompt token itself. The tiny model has 2 KV heads: at
TP=2 each rank holds one.

The two TP directions run on the same two servers, a TP=2 one and a TP=1 one, both `kv_both` (either role, as
each request's params say), with a router in front of each direction: one start-up of two servers fewer (about
50 s here). The second direction asks prompts the first did not (`REVERSED`), so that neither server holds
them in its prefix cache and every one is pulled; each direction's counts are the decode server's deltas. The
TP=1 server is also the data-parallel prefill server's decode server, before the TP=2 one starts (one start-up
fewer again), asked prompts of its own (`DP_PROMPTS`).

This host has 2 cores, fewer than the two servers' ranks: they are bound as a user would bind them, the TP=2
server's ranks on cores 0 and 1 ("0|1"), the TP=1 server on core 1, beside rank 1 (cluster/vllm_pd.py's
with_tp). Before kvwire's UCX polls napped once nothing moved (connectors/spin.py), this binding made every
first pull between the servers miss its 30 s deadline: both TP directions failed here, decode computing the
prompts itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_cluster import VLLMServer, VLLMServerSpec, live_group_members, start_all
from kvwire.cluster.vllm_pd import ALWAYS_DISAGGREGATE, PDCluster, kvwire_pair, start_router, with_tp
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory
from tests.vllm.conftest import PROMPTS
from tests.vllm.routed import Answer, chat, complete, grown_since, openai_client

pytest.importorskip("openai")

# Tokens per answer. A TP=2 decode server is slow here (two ranks sharing 2 cores with the other server's
# spinning worker); the pulled KV is in every token's top-2 logprobs from the first one on, so 8 tell what 24 did
# (routed.py's checks on TP=1 pairs answer 24).
MAX_TOKENS = 8
# the TP=1 -> TP=2 direction's prompts: their first block differs from every prompt of PROMPTS
REVERSED = [f"In reverse, {p}" for p in PROMPTS]
DIRECTIONS = {"P-TP2-D-TP1": PROMPTS, "P-TP1-D-TP2": REVERSED}
# the data-parallel test's, on the TP=1 server before P-TP2-D-TP1 asks it PROMPTS: their first block differs too
DP_PROMPTS = [f"Two engines: {p}" for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_answers(plain_server: VLLMServer, vllm_model_dir: Path) -> dict[str, tuple[Answer, Answer]]:
    """The plain server's completion and chat answer to each prompt, asked once for every shape (and not
    between a pair's requests, where the plain server's worker spinning after its step starves idle ranks)."""
    plain, model = openai_client(plain_server.url), str(vllm_model_dir)
    return {p: (complete(plain, model, p, MAX_TOKENS), chat(plain, model, p, MAX_TOKENS))
            for p in PROMPTS + REVERSED + DP_PROMPTS}


@pytest.fixture(scope="module")
def tp_specs(vllm_model_dir: Path, redis_server: LocalRedis, tmp_path_factory) -> tuple[VLLMServerSpec, ...]:
    """The TP=2 and the TP=1 server, both kv_both."""
    log_dir = tmp_path_factory.mktemp("tp")
    pair = with_tp(kvwire_pair(vllm_model_dir, redis_server.url, ConnectorKind.UCX, log_dir, named=False), 2, 1)
    return tuple(dataclasses.replace(s, kv_role="kv_both") for s in pair)


@pytest.fixture(scope="module")
def one(tp_specs: tuple[VLLMServerSpec, ...]) -> Iterator[VLLMServer]:
    """The TP=1 server: the data-parallel test's decode server, then the TP=2 server's partner both ways. Started,
    not waited for: its start-up runs beside the data-parallel prefill server's."""
    server = VLLMServer(tp_specs[1]).start()
    try:
        yield server
    finally:
        group = server.proc.pid if server.proc is not None else None
        server.stop()
    assert group is None or live_group_members(group) == [], "a server's rank outlived it"


def _data_parallel(prefill: VLLMServerSpec) -> VLLMServerSpec:
    """A prefill server of two data-parallel engines (the API server spreads requests over them), each a node of
    its own (`<id>_dp<rank>`); its engines unbound."""
    return dataclasses.replace(prefill, cpu_cores="nobind", extra_args=("--data-parallel-size", "2"))


# first: the TP=2 server is not started yet (a module fixture lives until the module's end)
def test_data_parallel_prefill_and_decode_equal_plain(one: VLLMServer,
                                                      plain_answers: dict[str, tuple[Answer, Answer]],
                                                      plain_server: VLLMServer, vllm_model_dir: Path, redis_url: str,
                                                      tmp_path: Path):
    """Each engine of a DP server is a node of its own: `<node_id>-dp<rank>` under a given id (vLLM runs a dense
    model's engines as DP=1 engines, so the rank comes from the engine id), vLLM's `_dp<rank>` engine ids
    without. Both servers start at once (one start-up's wait, not two) behind one router. The second, kv_both,
    then decodes for `one`: a request of n=3 choices is pulled once (the router names one engine for all three,
    x-data-parallel-rank; vLLM would spread them over both, and the second engine's pull would fail)."""
    # `one` first: it starts while the plain server is asked its answers
    specs = [_data_parallel(kvwire_pair(vllm_model_dir, redis_url, ConnectorKind.UCX, tmp_path / kind,
                                        named=kind == "named")[0]) for kind in ("named", "default")]
    specs[1] = dataclasses.replace(specs[1], kv_role="kv_both")
    servers = [VLLMServer(spec).start() for spec in specs]
    try:
        for server in servers:
            server.wait_ready()
        one.wait_ready()
        directory = KVDirectory(redis_url)
        try:
            ids = {n.node_id for n in directory.live_nodes(engine=None)}
        finally:
            directory.close()
        assert {"prefill-ucx-dp0", "prefill-ucx-dp1"} <= ids, ids
        assert len([i for i in ids if i.startswith("vllm-") and i.endswith(("_dp0", "_dp1"))]) == 2, ids
        url, router = start_router([s.url for s in servers], [one.url], tmp_path / "router.log", ALWAYS_DISAGGREGATE)
        try:
            _routed_equal_plain(PDCluster(servers[0], one, url, [router]), DP_PROMPTS, plain_answers,
                                str(vllm_model_dir), parts=1, prefill_instances=2)
        finally:
            router.terminate()
            router.wait(10)
        url, router = start_router([one.url], [servers[1].url], tmp_path / "router-dp-decode.log",
                                   ALWAYS_DISAGGREGATE)
        try:
            _choices_pulled_once(PDCluster(one, servers[1], url, [router]), plain_server, str(vllm_model_dir))
        finally:
            router.terminate()
            router.wait(10)
    finally:
        groups = [s.proc.pid for s in servers if s.proc is not None]
        for server in servers:
            server.stop()
    assert all(live_group_members(g) == [] for g in groups), "a server's rank outlived it"


@pytest.fixture(scope="module")
def directions(tp_specs: tuple[VLLMServerSpec, ...], one: VLLMServer,
               tmp_path_factory) -> Iterator[dict[str, PDCluster]]:
    """The TP=2 server, and a router (every request disaggregated) for each direction between it and `one`."""
    log_dir = tmp_path_factory.mktemp("tp-routers")
    two = start_all([tp_specs[0]])[0]
    clusters: dict[str, PDCluster] = {}
    try:
        one.wait_ready()
        for name, (prefill, decode) in zip(DIRECTIONS, [(two, one), (one, two)]):
            url, router = start_router([prefill.url], [decode.url], log_dir / f"router-{name}.log",
                                       ALWAYS_DISAGGREGATE)
            clusters[name] = PDCluster(prefill, decode, url, [router])
        yield clusters
    finally:
        for cluster in clusters.values():
            cluster.routers[0].terminate()
            cluster.routers[0].wait(10)
        group = two.proc.pid if two.proc is not None else None
        two.stop()
    assert group is None or live_group_members(group) == [], "a server's rank outlived it"


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_tp_pairs_equal_plain(plain_answers: dict[str, tuple[Answer, Answer]], directions: dict[str, PDCluster],
                              vllm_model_dir: Path, direction: str):
    # TP2 -> TP1: the decode rank reads a part of each prefill rank; TP1 -> TP2: each decode rank reads its own
    _routed_equal_plain(directions[direction], DIRECTIONS[direction], plain_answers, str(vllm_model_dir), parts=2)


def _choices_pulled_once(cluster: PDCluster, plain_server: VLLMServer, model: str) -> None:
    """Requests of n=3 choices through `cluster`'s router to its data-parallel decode server: each equal to the
    plain server's, each pulled once, nothing recomputed."""
    routed, plain = openai_client(cluster.router_url), openai_client(plain_server.url)
    pulls, failed = cluster.kv_pulls(), cluster.kv_failed_by_reason()
    prompts = [f"Three choices, one engine: {p}" for p in PROMPTS[:2]]
    for prompt in prompts:
        ask = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "n": 3, "temperature": 1.0, "seed": 5}
        got = routed.completions.with_raw_response.create(**ask)
        assert got.headers["x-kvwire-path"] == "disaggregated", dict(got.headers)
        assert [c.text for c in got.parse().choices] == [c.text for c in plain.completions.create(**ask).choices]
    assert cluster.kv_pulls() - pulls == len(prompts)
    assert grown_since(failed, cluster.kv_failed_by_reason()) == {}, "recomputed prompts, by reason"


def _routed_equal_plain(cluster: PDCluster, prompts: list[str], plain_answers: dict[str, tuple[Answer, Answer]],
                        model: str, parts: int, prefill_instances: int = 1) -> None:
    """Each prompt through `cluster`'s router, whole and as chat, gives the plain server's tokens (and top
    logprobs), every one of them pulled (`parts` pulls a prompt at least): the decode server's counts grow by the
    pulls, by no recompute and by no prompt token computed there."""
    routed = openai_client(cluster.router_url)
    by_source, pulls, failed = cluster.prompt_tokens_by_source(), cluster.kv_pulls(), cluster.kv_failed_by_reason()
    for prompt in prompts:
        want, want_chat = plain_answers[prompt]
        got = complete(routed, model, prompt, MAX_TOKENS)
        assert got.text == want.text and len(got.top_logprobs) == MAX_TOKENS
        for mine, theirs in zip(got.top_logprobs, want.top_logprobs):
            assert sorted(mine) == sorted(theirs) and mine == pytest.approx(theirs, abs=2e-3)
        assert chat(routed, model, prompt, MAX_TOKENS).text == want_chat.text
    grown = grown_since(by_source, cluster.prompt_tokens_by_source())
    assert grown.get("local_compute", 0) == 0, f"decode computed prompt tokens itself: {grown}"
    assert grown.get("external_kv_transfer", 0) > 0, grown
    # the first answer of each prefill instance shows its TP size; every later decode step starts alongside
    reasons = cluster.path_reasons()
    assert 1 <= reasons["prefilled"] <= prefill_instances, reasons
    assert reasons["prefilled"] + reasons["prefilled-alongside"] == 2 * len(prompts), reasons
    pulled = cluster.kv_pulls() - pulls
    assert pulled >= len(prompts) * parts, f"{parts} parts of each prompt pulled: {pulled}"
    assert grown_since(failed, cluster.kv_failed_by_reason()) == {}, "recomputed prompts, by reason"

