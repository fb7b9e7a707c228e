"""kv_connector_extra_config and kv_transfer_params as KvwireConnector reads them (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.vllm.params import RemotePrefill, remote_params, wants_remote_decode
from kvwire.connectors.vllm.settings import KVRole, VLLMSettings

URL = "redis://127.0.0.1:6379/0"


def test_settings_apply_every_key():
    s = VLLMSettings.parse("kv_consumer", {"redis_url": URL, "transport": "tcp", "node_id": "d0", "host": "10.0.0.2",
                                           "kv_deadline_s": 5, "entry_ttl_s": 50, "pull_lanes": 4}, 14579)
    config = s.connector_config()
    assert (config.kind, config.role, config.node_id, config.host) == (ConnectorKind.TCP, NodeRole.DECODE, "d0",
                                                                      "10.0.0.2")
    assert (config.kv_deadline_s, config.entry_ttl_s, config.pull_lanes) == (5.0, 50.0, 4)
    assert s.role == KVRole.CONSUMER and s.role.consumes and not s.role.produces


def test_settings_defaults_name_the_node_after_host_and_kv_port():
    s = VLLMSettings.parse("kv_both", {"redis_url": URL}, 14600)
    assert s.transport == ConnectorKind.UCX and s.node_id.endswith("-14600")
    assert s.role.produces and s.role.consumes


@pytest.mark.parametrize(("role", "extra", "match"), [
    ("kv_both", {}, "redis_url"),
    ("kv_both", {"redis_url": URL, "bogus_key": "x"}, "unknown"),
    ("kv_both", {"redis_url": URL, "host": "0.0.0.0", "advertise_host": "0.0.0.0"}, "wildcard"),
    ("kv_both", {"redis_url": URL, "transport": "carrier-pigeon"}, "transport"),
    ("kv_sideways", {"redis_url": URL}, "kv_role"),
    ("kv_both", {"redis_url": URL, "kv_deadline_s": "soon"}, "malformed"),
    ("kv_both", {"redis_url": URL, "kv_deadline_s": 90, "entry_ttl_s": 10}, "entry_ttl_s"),
    ("kv_both", {"redis_url": URL, "pull_lanes": 99}, "pull_lanes"),
])
def test_settings_refuse_what_they_do_not_do(role, extra, match):
    with pytest.raises(ValueError, match=match):
        VLLMSettings.parse(role, extra, 14579)


def test_advertise_host_is_what_peers_are_told():
    s = VLLMSettings.parse("kv_producer", {"redis_url": URL, "host": "0.0.0.0", "advertise_host": "10.1.2.3"}, 1)
    config = s.connector_config()
    assert (config.host, config.advertised_host) == ("0.0.0.0", "10.1.2.3")
    assert VLLMSettings.parse("kv_producer", {"redis_url": URL}, 1).connector_config().advertised_host == "127.0.0.1"


def test_params_round_trip_from_producer_to_consumer():
    params = remote_params("cmpl-1-0", "prefill-0", [4, 5, 6], 300)
    remote = RemotePrefill.of("decode-req", params)
    assert remote == RemotePrefill("cmpl-1-0", "prefill-0", 300, [4, 5, 6])
    assert not wants_remote_decode(params) and wants_remote_decode({"do_remote_decode": True})


@pytest.mark.parametrize("params", [
    None, {}, {"do_remote_decode": True},
    {"do_remote_prefill": True, "remote_request_id": "r"},  # incomplete
    {**remote_params("r", "p", [1], 10), "remote_num_tokens": "ten"},  # malformed
    {**remote_params("r", "p", [1], 10), "transfer": "nixl"},  # another connector's
])
def test_params_that_announce_no_usable_remote_prefill(params):
    assert RemotePrefill.of("req", params) is None


def test_keep_epoch_keeps_the_counter_alive(redis_url):
    """vLLM servers register no node (no heartbeat): the connector keeps its epoch counter alive itself."""
    import redis

    from kvwire.connectors.directory import KVDirectory

    directory, client = KVDirectory(redis_url, entry_ttl_s=1.0), redis.Redis.from_url(redis_url)
    try:
        epoch = directory.next_epoch("vllm-n1")
        key = next(iter(client.scan_iter("*epoch*vllm-n1")))
        client.pexpire(key, 50)
        directory.keep_epoch("vllm-n1", epoch)
        assert client.pttl(key) > 1000
        client.flushall()  # Redis lost its data: the counter comes back, and a new incarnation draws above it
        directory.keep_epoch("vllm-n1", epoch)
        assert directory.next_epoch("vllm-n1") == epoch + 1
    finally:
        directory.close()
        client.close()
