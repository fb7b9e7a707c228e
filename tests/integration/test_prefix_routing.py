"""End to end: a prefill node, two decode nodes keeping prefix caches and a router with `--decode-only-below 32`.

A conversation's turns stay on one decode node; its later turns go decode-only there (reason cached-on-decode),
start on the blocks of the earlier turns the node kept, and answer what one process answers; unrelated prompts
use both decode nodes."""

from __future__ import annotations

import httpx2
import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.cluster.vllm_pd import counter_by_label
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import complete, wait_pools_full_and_directory_empty
from tests.procs import FORK

pytestmark = pytest.mark.slow
BS, MAX_TOKENS = 16, 12


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model_dir=tiny_model_dir, block_size=BS, num_blocks=256, decode_nodes=2, decode_only_below=32,
                       log_dir=tmp_path_factory.mktemp("cluster-logs"), launch=FORK)
    with LocalCluster(spec) as c:
        yield c


def _reference(model_dir, prompt: list[int]) -> list[int]:
    return generate(model_dir, [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), block_size=BS)[0]


def test_a_conversation_stays_on_one_decode_node_and_its_later_turns_are_decode_only(cluster, tiny_model_dir):
    prompt, seen = list(range(40, 140)), []  # 100 tokens
    for turn in range(3):
        got = complete(cluster.url, prompt, max_tokens=MAX_TOKENS)
        tokens, kv = got["choices"][0]["token_ids"], got["kvwire"]
        assert tokens == _reference(tiny_model_dir, prompt), f"turn {turn}"
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        seen.append((kv["path"], kv["reason"], kv["decode_node"], cached))
        assert cached == kv["cached_tokens"] and cached % BS == 0 and cached < len(prompt)
        prompt = prompt + tokens + [5, 6, 7]  # the next turn continues this one's answer
    (first_path, first_reason, node, first_cached), *later = seen
    assert (first_path, first_reason, first_cached) == ("disaggregated", "prefilled", 0)
    for path, reason, decode_node, cached in later:
        assert (path, reason, decode_node) == ("decode-only", "cached-on-decode", node)
        assert cached >= 96  # the first turn's 6 full prompt blocks at least: its prompt and answer after
    reasons = counter_by_label(cluster.url, "kvwire_path_reasons_total", "reason")
    assert reasons["cached-on-decode"] >= 2, reasons
    on_node = cluster.ops_urls["decode" if node == "decode-0" else node]
    text = httpx2.get(f"{on_node}/metrics", timeout=10).text
    assert any(line.startswith("kvwire_prompt_tokens_cached_total ") and float(line.split()[1]) >= 192
               for line in text.splitlines()), "the decode node did not count its cached prompt tokens"


def test_unrelated_prompts_use_both_decode_nodes(cluster, tiny_model_dir):
    """Equally free (cached blocks count as free), they take turns; a busier one would lose the next prompt."""
    pools, _ = wait_pools_full_and_directory_empty(cluster.redis_url)
    assert len(pools) == 3 and all(free == total for free, total in pools.values()), pools
    nodes = set()
    for start in (150, 250):
        prompt = list(range(start, start - 64, -1))
        got = complete(cluster.url, prompt, max_tokens=MAX_TOKENS)
        assert got["choices"][0]["token_ids"] == _reference(tiny_model_dir, prompt)
        assert (got["kvwire"]["path"], got["kvwire"]["cached_tokens"]) == ("disaggregated", 0)
        nodes.add(got["kvwire"]["decode_node"])
    assert nodes == {"decode-0", "decode-1"}


def _prefill_cached_tokens(cluster) -> float:
    text = httpx2.get(f"{cluster.ops_urls['prefill']}/metrics", timeout=10).text
    return sum(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("kvwire_prompt_tokens_cached_total "))


def test_prompts_sharing_a_system_prompt_compute_it_once_on_the_prefill_node(cluster, tiny_model_dir):
    """Questions after one system prompt: the prefill node computes the system prompt's blocks once and starts the
    later prompts on them. Each prompt is still disaggregated; the first pulls its whole KV, the later ones (on the
    decode node that holds the system prompt's blocks) only the blocks after them. The decode node computes none
    of it, and each answers what one process answers."""
    system = list(range(200, 280))  # 80 tokens: 5 full blocks
    before = _prefill_cached_tokens(cluster)
    seen = []
    for question in ([7] * 40, [8] * 41, [9] * 42):  # past --decode-only-below (32) beyond the system prompt
        prompt = system + question
        got = complete(cluster.url, prompt, max_tokens=MAX_TOKENS)
        assert got["choices"][0]["token_ids"] == _reference(tiny_model_dir, prompt)
        kv = got["kvwire"]
        assert (kv["path"], kv["bypassed"]) == ("disaggregated", True), kv
        seen.append((kv["decode_node"], kv["cached_tokens"], kv["kv_bytes"]))
    assert _prefill_cached_tokens(cluster) - before == 2 * len(system)
    (node, cached, whole), *later = seen
    assert cached == 0 and whole > 0
    for decode_node, cached, nbytes in later:  # 3 blocks of 8 pulled, not 8
        assert (decode_node, cached) == (node, len(system)) and 0 < nbytes < whole / 2
