"""End to end: a conversation kept on its decode node as cached-on-decode whose blocks that node has since evicted
is computed there again, and counted: kvwire_recomputes_total{reason="prefix_miss"} on the decode node, and
`prefix_miss:1` in `kvwire status` (the heartbeat's NodeInfo). Turns whose blocks were there count nothing.

One prefill and one decode node of 24 blocks of 16 tokens each, a router with `--decode-only-below 32`: two
unrelated 200-token prompts fill the decode node's pool, its prefix cache evicts the conversation's blocks, and
the router, which predicts what a node holds from what it sent it (router/prefix_index.py), still takes them to
be there."""

from __future__ import annotations

import time

import httpx2
import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.cluster.status import read_status
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import complete
from tests.procs import FORK

pytestmark = pytest.mark.slow
BS, MAX_TOKENS = 16, 12
STATUS_WAIT_S = 15.0  # a few heartbeats, on a busy machine


def _misses(cluster: LocalCluster) -> float:
    text = httpx2.get(f"{cluster.ops_urls['decode']}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith('kvwire_recomputes_total{reason="prefix_miss"}'))


def _status_misses(redis_url: str) -> str:
    directory = KVDirectory(redis_url)
    try:
        decode = next(n for n in read_status(directory).nodes if n.node_id == "decode-0")
    finally:
        directory.close()
    return f"{decode.prefix_misses}"


def test_a_turn_kept_on_decode_whose_blocks_were_evicted_is_a_counted_prefix_miss(tiny_model_dir, tmp_path):
    spec = ClusterSpec(model_dir=tiny_model_dir, block_size=BS, num_blocks=24, decode_only_below=32,
                       log_dir=tmp_path, launch=FORK)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LocalCluster(spec) as cluster:
        prompt, reasons = list(range(40, 140)), []  # 100 tokens
        for turn in range(3):
            if turn == 2:  # other users' prompts take the decode node's blocks
                for start in (150, 200):
                    complete(cluster.url, [(start + i) % 300 for i in range(200)], max_tokens=1)
                assert _misses(cluster) == 0, "turns whose blocks were in the cache are no miss"
            got = complete(cluster.url, prompt, max_tokens=MAX_TOKENS)
            tokens, kv = got["choices"][0]["token_ids"], got["kvwire"]
            assert tokens == generate(tiny_model_dir, [prompt], params, block_size=BS)[0], f"turn {turn}"
            reasons.append((kv["reason"], kv["cached_tokens"]))
            prompt = prompt + tokens + [5, 6, 7]
        assert [r for r, _ in reasons] == ["prefilled", "cached-on-decode", "cached-on-decode"]
        assert reasons[1][1] >= 96 and reasons[2][1] == 0, reasons  # the third found nothing of the conversation
        assert _misses(cluster) == 1
        deadline = time.monotonic() + STATUS_WAIT_S
        while _status_misses(cluster.redis_url) != "1":
            assert time.monotonic() < deadline, "kvwire status never showed the prefix miss"
            time.sleep(0.1)
