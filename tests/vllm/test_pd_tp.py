"""Tensor- and data-parallel vLLM servers with KvwireConnector, against one plain vLLM server.

The minimal connector config (no node_id) on both servers, the kvwire router in front, the official
`openai` client: a TP=2 prefill server feeding a TP=1 decode server, the reverse, and a prefill server of two
data-parallel engines (each its own node; the API server spreads the requests over them). Each decode rank
pulls its KV heads from the prefill ranks that hold them (connectors/vllm/tp.py); the answers equal the
plain server's and the decode server computes no prompt token itself. The tiny model has 2 KV heads: at
TP=2 each rank holds one.

This host has 2 cores, fewer than the two servers' ranks: every rank runs unbound ("nobind"). vLLM's
engines step without pause while a transfer is pending (its workers poll their queues), so a rank pinned to a
core that others spin on too gets too little of it to serve or pull the KV before the deadline. The server of
two ranks runs at idle priority (cluster/vllm_pd.py's with_tp says why).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvwire.cluster.vllm_cluster import VLLMServer, VLLMServerSpec, live_group_members
from kvwire.cluster.vllm_pd import kvwire_pair, pd_cluster_of, with_tp
from kvwire.connectors.config import ConnectorKind
from tests.vllm.conftest import PROMPTS
from tests.vllm.test_pd_servers import Answer, _chat, _client, _complete

pytest.importorskip("openai")


def _data_parallel_prefill(pair: tuple[VLLMServerSpec, VLLMServerSpec]) -> tuple[VLLMServerSpec, VLLMServerSpec]:
    """Prefill with two data-parallel engines (the API server spreads requests over them), each a node of its
    own (`<id>_dp<rank>`); every engine unbound, as with TP."""
    prefill, decode = pair
    return (dataclasses.replace(prefill, cpu_cores="nobind", extra_args=("--data-parallel-size", "2")),
            dataclasses.replace(decode, cpu_cores="nobind"))


SHAPES = {"P-TP2-D-TP1": lambda pair: with_tp(pair, 2, 1), "P-TP1-D-TP2": lambda pair: with_tp(pair, 1, 2),
          "P-DP2-D-TP1": _data_parallel_prefill}


# Tokens per answer. A TP=2 decode server makes 2 to 6 tokens/s here (two ranks at idle priority sharing what
# the prefill server's spinning worker leaves of 2 cores); the pulled KV is in every token's top-2 logprobs from
# the first one on, so 8 tell what 24 did (test_pd_servers.py's TP=1 pairs answer 24).
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def plain_answers(plain_server: VLLMServer, vllm_model_dir: Path) -> dict[str, tuple[Answer, Answer]]:
    """The plain server's completion and chat answer to each of PROMPTS, asked once for every shape (and not
    between a pair's requests, where the plain server's worker spinning after its step starves idle ranks)."""
    plain, model = _client(plain_server.url), str(vllm_model_dir)
    return {p: (_complete(plain, model, p, MAX_TOKENS), _chat(plain, model, p, MAX_TOKENS)) for p in PROMPTS}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_parallel_pairs_equal_plain(plain_answers: dict[str, tuple[Answer, Answer]], vllm_model_dir: Path,
                                    redis_url: str, tmp_path: Path, shape: str):
    model = str(vllm_model_dir)
    pair = SHAPES[shape](kvwire_pair(vllm_model_dir, redis_url, ConnectorKind.UCX, tmp_path, named=False))
    with pd_cluster_of(*pair, tmp_path) as cluster:
        routed = _client(cluster.router_url)
        for prompt in PROMPTS:
            want, want_chat = plain_answers[prompt]
            got = _complete(routed, model, prompt, MAX_TOKENS)
            assert got.text == want.text and len(got.top_logprobs) == MAX_TOKENS
            for mine, theirs in zip(got.top_logprobs, want.top_logprobs):
                assert sorted(mine) == sorted(theirs) and mine == pytest.approx(theirs, abs=2e-3)
            assert _chat(routed, model, prompt, MAX_TOKENS).text == want_chat.text
        by_source = cluster.prompt_tokens_by_source()
        pulls, failed, reasons = cluster.kv_pulls(), cluster.kv_failed_by_reason(), cluster.path_reasons()
        groups = [s.proc.pid for s in (cluster.prefill, cluster.decode) if s.proc is not None]
    assert by_source["local_compute"] == 0, f"decode computed prompt tokens itself: {by_source}"
    assert by_source["external_kv_transfer"] > 0, by_source
    # the first answer shows the prefill server's TP size; every later decode step starts alongside its prefill
    assert reasons["prefilled"] == 1 and reasons["prefilled-alongside"] == 2 * len(PROMPTS) - 1, reasons
    assert pulls >= len(PROMPTS) * (2 if "TP2" in shape else 1), f"one part per prefill rank read: {pulls}"
    assert sum(failed.values()) == 0, f"recomputed prompts, by reason: {failed}"
    assert [pid for g in groups for pid in live_group_members(g)] == [], "a server's rank outlived it"
