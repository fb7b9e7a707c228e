"""`--advertise-host`: the address a node publishes, and its default when --host is a wildcard."""

from __future__ import annotations

import pytest
import typer

from kvwire.cli.options import node_config
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.directory import advertise
from kvwire.connectors.directory.advertise import advertise_host, directory_address, route_source


def _local_address() -> str:
    """A non-loopback address of this machine (the default route's source), or skip."""
    found = route_source("198.51.100.1", 9)
    if found is None or found.startswith("127."):
        pytest.skip("this machine has no route besides loopback")
    return found


def test_an_explicit_advertise_host_wins_and_a_wildcard_one_is_refused():
    assert advertise_host("0.0.0.0", "10.1.2.3", "redis://127.0.0.1:6379") == "10.1.2.3"
    assert advertise_host("127.0.0.1", "node-7.example", "redis://127.0.0.1:6379") == "node-7.example"
    with pytest.raises(ValueError, match="names no address"):
        advertise_host("0.0.0.0", "0.0.0.0", "redis://127.0.0.1:6379")


def test_a_specific_bind_address_is_the_one_published():
    assert advertise_host("127.0.0.1", None, "redis://10.9.9.9:6379") == "127.0.0.1"
    assert advertise_host("10.4.0.7", None, "redis://127.0.0.1:6379") == "10.4.0.7"


def test_a_wildcard_publishes_the_address_that_routes_to_redis():
    local = _local_address()
    assert advertise_host("0.0.0.0", None, f"redis://{local}:6379/0") == local
    assert advertise_host("0.0.0.0", None, f"redis+sentinel://{local}:26379,10.0.0.9/mymaster") == local


def test_a_wildcard_never_publishes_loopback_even_with_redis_on_loopback():
    local = _local_address()
    assert advertise_host("0.0.0.0", None, "redis://127.0.0.1:6379") == local


def test_a_wildcard_with_only_loopback_to_offer_is_refused(monkeypatch):
    monkeypatch.setattr(advertise, "route_source", lambda host, port: "127.0.0.1")
    monkeypatch.setattr(advertise, "_hostname_address", lambda: "127.0.1.1")
    with pytest.raises(ValueError, match="give an advertise host"):
        advertise_host("0.0.0.0", None, "redis://127.0.0.1:6379")


def test_directory_address_of_each_url_form():
    assert directory_address("redis://:pw@10.0.0.5:7000/2") == ("10.0.0.5", 7000)
    assert directory_address("rediss://cache.example") == ("cache.example", 6379)
    assert directory_address("redis+sentinel://s1:26380,s2/master") == ("s1", 26380)


def test_node_config_resolves_the_default_and_reports_bad_ones(tiny_model_dir):
    local = _local_address()

    def build(**kw):
        return node_config(NodeRole.PREFILL, model=tiny_model_dir, redis_url=f"redis://{local}:1", port=0,
                           node_id="p", connector=ConnectorKind.TCP, block_size=16, num_blocks=8, kv_deadline=1.0,
                           max_model_len=0, device="cpu", torch_threads=1, **kw)

    config = build(host="0.0.0.0")
    assert (config.host, config.connector.advertised_host) == ("0.0.0.0", local)
    assert build(host="127.0.0.1").connector.advertised_host == "127.0.0.1"
    with pytest.raises(typer.BadParameter, match="names no address"):
        build(host="0.0.0.0", advertise_host="0.0.0.0")


def test_a_connector_config_never_publishes_a_wildcard():
    with pytest.raises(ValueError, match="wildcard"):
        ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.DECODE, node_id="d", redis_url="redis://x",
                        host="0.0.0.0")
    ok = ConnectorConfig(kind=ConnectorKind.TCP, role=NodeRole.DECODE, node_id="d", redis_url="redis://x",
                         host="0.0.0.0", advertise_host="10.0.0.2")
    assert ok.advertised_host == "10.0.0.2"
