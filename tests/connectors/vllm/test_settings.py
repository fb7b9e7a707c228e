"""kv_connector_extra_config and kv_transfer_params as KvwireConnector reads them (no vLLM needed)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.vllm.identity import EngineShape
from kvwire.connectors.vllm.params import (
    ANNOUNCED_AHEAD,
    KEY,
    RemotePrefill,
    key_of,
    remote_params,
    wants_remote_decode,
)
from kvwire.connectors.vllm.settings import KVRole, VLLMSettings

URL = "redis://127.0.0.1:6379/0"
ONE = EngineShape("3f2a9c1e-0b7d-4c6e-9a51-2d8e4f6a7b90")  # what vLLM gives a server: a new uuid


def test_settings_apply_every_key():
    s = VLLMSettings.parse("kv_consumer", {"redis_url": URL, "transport": "tcp", "node_id": "d0", "host": "10.0.0.2",
                                           "kv_deadline_s": 5, "entry_ttl_s": 50, "pull_lanes": 4,
                                           "directory_wait_s": 7.5}, ONE)
    config = s.connector_config()
    assert (config.kind, config.role, config.node_id, config.host) == (ConnectorKind.TCP, NodeRole.DECODE, "d0",
                                                                      "10.0.0.2")
    assert (config.kv_deadline_s, config.entry_ttl_s, config.pull_lanes) == (5.0, 50.0, 4)
    assert s.role == KVRole.CONSUMER and s.role.consumes and not s.role.produces
    assert s.directory_wait_s == 7.5 and VLLMSettings.parse("kv_both", {"redis_url": URL}, ONE).directory_wait_s == 60


def test_settings_defaults_name_each_server_apart():
    """vLLM's examples give no node_id: two servers on one host must still be two nodes."""
    s = VLLMSettings.parse("kv_both", {"redis_url": URL}, ONE)
    other = VLLMSettings.parse("kv_both", {"redis_url": URL}, EngineShape("9d0e4b2a-1c3f-4e5a-8b6c-7d8e9f0a1b2c"))
    assert s.transport == ConnectorKind.AUTO and s.node_id.startswith("vllm-") and s.node_id.endswith("-3f2a9c1e")
    assert other.node_id != s.node_id
    assert s.role.produces and s.role.consumes


def test_each_data_parallel_engine_is_its_own_node():
    dp = [EngineShape(f"{ONE.engine_id}_dp{r}", data_parallel=True, data_parallel_rank=r) for r in (0, 1)]
    assert [VLLMSettings.parse("kv_producer", {"redis_url": URL}, e).node_id[-12:] for e in dp] == \
        ["3f2a9c1e_dp0", "3f2a9c1e_dp1"]  # vLLM's engine ids already name the rank
    given = [VLLMSettings.parse("kv_producer", {"redis_url": URL, "node_id": "p"}, e).node_id for e in dp]
    assert given == ["p-dp0", "p-dp1"]
    assert VLLMSettings.parse("kv_producer", {"redis_url": URL, "node_id": "p"}, ONE).node_id == "p", \
        "a given id is kept as it is: a restart under it fences its last incarnation"


def _vllm_config(engine_id: str, dp_size: int, dp_rank: int, dp_index: int) -> SimpleNamespace:
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=dp_size,
                               data_parallel_rank=dp_rank, data_parallel_index=dp_index)
    return SimpleNamespace(parallel_config=parallel, model_config=None,
                           kv_transfer_config=SimpleNamespace(engine_id=engine_id))


def test_a_dense_models_data_parallel_engines_keep_their_rank_under_a_given_node_id():
    """vLLM runs a dense model's DP engines as DP=1 engines (size 1, rank 0); the engine id and
    data_parallel_index still say which engine this is, so `node_id` gets `-dp<rank>` on each."""
    dense = [EngineShape.of(_vllm_config(f"e_dp{r}", 1, 0, r)) for r in (0, 1)]
    moe = [EngineShape.of(_vllm_config(f"e_dp{r}", 2, r, r)) for r in (0, 1)]
    for engines in (dense, moe):
        names = [VLLMSettings.parse("kv_producer", {"redis_url": URL, "node_id": "pre-a"}, e).node_id for e in engines]
        assert names == ["pre-a-dp0", "pre-a-dp1"]
    alone = EngineShape.of(_vllm_config("e", 1, 0, 0))
    assert VLLMSettings.parse("kv_producer", {"redis_url": URL, "node_id": "pre-a"}, alone).node_id == "pre-a"


def test_pipeline_parallel_servers_and_uneven_splits_are_refused_at_start_up():
    with pytest.raises(ValueError, match="moves the KV of PP=1 servers only"):
        VLLMSettings.parse("kv_producer", {"redis_url": URL}, EngineShape("e", pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="do not split evenly"):
        VLLMSettings.parse("kv_producer", {"redis_url": URL}, EngineShape("e", tensor_parallel_size=4, kv_heads=6))


def test_an_fp8_kv_cache_is_moved_and_one_whose_scales_live_apart_is_refused_at_start_up():
    config = _vllm_config("e", 1, 0, 0)
    for given, quant in (("auto", ""), ("bfloat16", ""), ("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2")):
        config.cache_config = SimpleNamespace(cache_dtype=given)
        engine = EngineShape.of(config)
        assert engine.kv_quant == quant
        VLLMSettings.parse("kv_producer", {"redis_url": URL}, engine)
    with pytest.raises(ValueError, match="int8_per_token_head, whose scales live apart from its blocks"):
        VLLMSettings.parse("kv_producer", {"redis_url": URL}, EngineShape("e", kv_quant="int8_per_token_head"))


def test_each_tensor_parallel_rank_is_its_own_node():
    ranks = [EngineShape("e", tensor_parallel_size=2, tensor_rank=r, kv_heads=4) for r in (0, 1)]
    settings = [VLLMSettings.parse("kv_producer", {"redis_url": URL, "node_id": "p"}, e) for e in ranks]
    assert [s.node_id for s in settings] == ["p", "p"], "the server's name, what kv_transfer_params carry"
    assert [s.connector_config().node_id for s in settings] == ["p-tp0", "p-tp1"]
    assert VLLMSettings.parse("kv_producer", {"redis_url": URL, "node_id": "p"}, ONE).connector_config().node_id == "p"


@pytest.mark.parametrize(("role", "extra", "match"), [
    ("kv_both", {}, "redis_url"),
    ("kv_both", {"redis_url": URL, "bogus_key": "x"}, "unknown"),
    ("kv_both", {"redis_url": URL, "host": "0.0.0.0", "advertise_host": "0.0.0.0"}, "wildcard"),
    ("kv_both", {"redis_url": URL, "transport": "carrier-pigeon"}, "transport"),
    ("kv_sideways", {"redis_url": URL}, "kv_role"),
    ("kv_both", {"redis_url": URL, "kv_deadline_s": "soon"}, "malformed"),
    ("kv_both", {"redis_url": URL, "kv_deadline_s": 90, "entry_ttl_s": 10}, "entry_ttl_s"),
    ("kv_both", {"redis_url": URL, "pull_lanes": 99}, "pull_lanes"),
    ("kv_both", {"redis_url": URL, "directory_wait_s": -1}, "directory_wait_s"),
])
def test_settings_refuse_what_they_do_not_do(role, extra, match):
    with pytest.raises(ValueError, match=match):
        VLLMSettings.parse(role, extra, ONE)


def test_advertise_host_is_what_peers_are_told():
    s = VLLMSettings.parse("kv_producer", {"redis_url": URL, "host": "0.0.0.0", "advertise_host": "10.1.2.3"}, ONE)
    config = s.connector_config()
    assert (config.host, config.advertised_host) == ("0.0.0.0", "10.1.2.3")
    assert VLLMSettings.parse("kv_producer", {"redis_url": URL}, ONE).connector_config().advertised_host == "127.0.0.1"


def test_params_round_trip_from_producer_to_consumer():
    params = remote_params("cmpl-1-0", "prefill-0", ([4, 5, 6], [0, 7, 8]), 300)
    remote = RemotePrefill.of("decode-req", params)
    assert remote == RemotePrefill("cmpl-1-0", "prefill-0", 300, [[4, 5, 6], [0, 7, 8]])
    assert RemotePrefill.of("d", remote_params("c", "p", ([1],), 9, tp_size=2)).remote_tp_size == 2
    flat = {**params, "remote_block_ids": [4, 5, 6]}  # one group's list, as kvwire sent before groups
    assert RemotePrefill.of("decode-req", flat) == RemotePrefill("cmpl-1-0", "prefill-0", 300, [[4, 5, 6]])
    assert not wants_remote_decode(params) and wants_remote_decode({"do_remote_decode": True})


def test_params_announced_ahead_name_the_key_and_leave_the_rest_to_the_directory():
    ahead = {"do_remote_prefill": True, "remote_request_id": "kvwire-9f", "remote_tp_size": 2, "transfer": "kvwire"}
    remote = RemotePrefill.of("decode-req", ahead)
    assert remote == RemotePrefill("kvwire-9f", "", ANNOUNCED_AHEAD, [], remote_tp_size=2)


def test_a_producer_holds_under_the_proxys_key_when_it_gave_a_usable_one():
    assert key_of("cmpl-1", {"do_remote_decode": True, KEY: "kvwire-9f"}) == "kvwire-9f"
    assert key_of("cmpl-1", {"do_remote_decode": True}) == key_of("cmpl-1", None) == "cmpl-1"
    for bad in ("", "a b", "x" * 201, 7, "k\n"):
        assert key_of("cmpl-1", {"do_remote_decode": True, KEY: bad}) == "cmpl-1"
    assert remote_params(key_of("cmpl-1", {KEY: "kvwire-9f"}), "p", ([1],), 9)["remote_request_id"] == "kvwire-9f"


@pytest.mark.parametrize("params", [
    None, {}, {"do_remote_decode": True},
    {"do_remote_prefill": True, "remote_request_id": "r"},  # incomplete
    {**remote_params("r", "p", ([1],), 10), "remote_num_tokens": "ten"},  # malformed
    {**remote_params("r", "p", ([1],), 10), "transfer": "nixl"},  # another connector's
])
def test_params_that_announce_no_usable_remote_prefill(params):
    assert RemotePrefill.of("req", params) is None


def _node(directory, node_id: str, epoch: int, draining: bool = False):
    from kvwire.connectors.wire import NodeEngine, NodeInfo

    return NodeInfo(node_id=node_id, role=NodeRole.PREFILL, epoch=epoch, work_endpoint="",
                    connector=ConnectorKind.UCX, free_blocks=0, total_blocks=8, engine=NodeEngine.VLLM,
                    host="host-a", pid=4242, draining=draining)


def test_a_node_id_a_live_server_holds_is_refused_and_freed_when_it_stops(redis_url):
    """Two servers given one node_id: the second is refused, naming the first, instead of fencing it."""
    from kvwire.connectors.directory.directory import KVDirectory
    from kvwire.connectors.directory.heartbeat import Heartbeat
    from kvwire.connectors.vllm.identity import claim_node_id

    directory = KVDirectory(redis_url)
    first = _node(directory, "shared", claim_node_id(directory, "shared"))  # nobody holds it yet
    beat = Heartbeat(directory, lambda: first)
    try:
        beat.start()
        with pytest.raises(ValueError, match=r"'shared' is in use by a live server \(vllm prefill, pid 4242 on "
                                             r"host-a, epoch 1, last heartbeat \d+\.\d s ago\)"):
            claim_node_id(directory, "shared")
        assert [n.node_id for n in directory.live_nodes()] == [], "kvwire's routers never see a vLLM rank"
        assert [n.node_id for n in directory.live_nodes(engine=None)] == ["shared"]
        beat.stop()
        assert claim_node_id(directory, "shared") == 2  # stopped: deregistered, the id is free again
    finally:
        beat.stop()
        directory.close()


def test_of_servers_claiming_one_node_id_at_the_same_instant_exactly_one_gets_it(redis_url):
    """The check that nobody holds the id and the taking of it are one step: no interleaving lets two through."""
    import threading

    from kvwire.connectors.directory.directory import KVDirectory
    from kvwire.connectors.vllm.identity import claim_node_id

    directories = [KVDirectory(redis_url) for _ in range(3)]
    try:
        for round_ in range(30):
            start, won, refused = threading.Barrier(3), [], []

            def claim(directory: KVDirectory, node_id: str, start: threading.Barrier, won: list, refused: list) -> None:
                start.wait()
                try:
                    won.append(claim_node_id(directory, node_id))
                except ValueError as exc:
                    refused.append(str(exc))

            threads = [threading.Thread(target=claim, args=(d, f"race-{round_}", start, won, refused))
                       for d in directories]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert len(won) == 1 and len(refused) == 2, (won, refused)
            assert all("claimed a moment ago" in r or "in use by a live server" in r for r in refused)
    finally:
        for d in directories:
            d.close()


def test_a_claim_that_never_registers_lapses_and_a_draining_holder_may_be_replaced(redis_url):
    from kvwire.connectors.directory.directory import KVDirectory
    from kvwire.connectors.vllm.identity import claim_node_id

    directory = KVDirectory(redis_url, node_ttl_s=0.3)
    try:
        assert claim_node_id(directory, "crashed") == 1  # a server that died before it registered
        with pytest.raises(ValueError, match="claimed a moment ago"):
            claim_node_id(directory, "crashed")
        deadline = time.monotonic() + 5
        while (epoch := directory.claim_node("crashed")[0]) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert epoch == 2, "the claim lapses after node_ttl_s"
        directory.register_node(_node(directory, "crashed", 2, draining=True))  # a server draining for a restart
        assert claim_node_id(directory, "crashed") == 3
        directory.deregister_node("crashed")  # a start that failed after its claim frees the id at once
        assert claim_node_id(directory, "crashed") == 4
    finally:
        directory.close()


def test_a_server_starting_before_redis_claims_its_id_once_redis_answers():
    """A real redis-server started a second after the claim began, on the port the claim was given: the claim
    waits for it (directory_wait_s), then takes the id; past the wait, a DirectoryError."""
    from kvwire.cluster.ports import free_port
    from kvwire.cluster.redis_server import LocalRedis
    from kvwire.connectors.directory.connection import DirectoryError
    from kvwire.connectors.directory.directory import KVDirectory
    from kvwire.connectors.vllm.identity import claim_node_id

    port = free_port()
    directory = KVDirectory(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(DirectoryError, match="not answering after 0.3 s"):
        claim_node_id(directory, "early-vllm", 0.3)
    redis = LocalRedis(port=port)
    starter = threading.Timer(1.0, redis.start)
    starter.start()
    try:
        started = time.monotonic()
        assert claim_node_id(directory, "early-vllm", 30) >= 1
        assert 0.8 < time.monotonic() - started < 15
    finally:
        starter.join()
        directory.close()
        redis.stop()
