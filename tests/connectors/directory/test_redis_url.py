"""Redis URL forms of the directory: parsing, masking, and the pools they build (no server needed)."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.directory.redis_url import (
    DEFAULT_SENTINEL_PORT,
    connection_pool,
    is_sentinel_url,
    masked,
    parse_sentinel_url,
)


@pytest.mark.parametrize("url, want", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
    ("redis://kvwire:p%40ss@h:1/0", "redis://kvwire:***@h:1/0"),
    ("redis://kvwire@h:1/0", "redis://kvwire@h:1/0"),
    ("rediss://u:pw@h/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required",
     "rediss://u:***@h/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"),
    ("redis+sentinel://:pw@a:1,b:2/mymaster/0?sentinel_password=spw",
     "redis+sentinel://:***@a:1,b:2/mymaster/0?sentinel_password=***"),
])
def test_masked_hides_every_password(url, want):
    assert masked(url) == want


def test_sentinel_url_is_parsed_into_sentinels_service_and_credentials():
    t = parse_sentinel_url("redis+sentinel://app:p%3Aw@s1:26380,s2,[::1]:26381/cache/3?sentinel_password=spw"
                           "&sentinel_username=sent")
    assert t.sentinels == [("s1", 26380), ("s2", DEFAULT_SENTINEL_PORT), ("::1", 26381)]
    assert t.service == "cache"
    assert t.master_kwargs == {"db": 3, "username": "app", "password": "p:w"}
    assert t.sentinel_kwargs == {"username": "sent", "password": "spw"}


def test_tls_sentinel_url_passes_ssl_parameters_to_master_and_sentinels():
    t = parse_sentinel_url("rediss+sentinel://:pw@s1/m?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem"
                           "&ssl_keyfile=/k.pem&ssl_cert_reqs=required&ssl_check_hostname=false")
    ssl = {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem",
           "ssl_cert_reqs": "required", "ssl_check_hostname": False}
    assert t.master_kwargs == {"db": 0, "password": "pw", **ssl}
    assert t.sentinel_kwargs == ssl


@pytest.mark.parametrize("url", [
    "redis://h/0", "redis+sentinel://h1,h2", "redis+sentinel:///svc", "redis+sentinel://h:99999/svc",
    "redis+sentinel://h/svc/x", "redis+sentinel://h/svc?bogus=1", "redis+sentinel://h/svc?ssl_ca_certs=/ca.pem",
])
def test_bad_sentinel_urls_are_refused(url):
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


def test_errors_about_bad_urls_mask_the_password():
    with pytest.raises(ValueError) as info:
        parse_sentinel_url("redis+sentinel://:hunter2@h/svc?bogus=1")
    assert "hunter2" not in str(info.value) and ":***@" in str(info.value)


def test_tls_url_query_parameters_reach_the_connections():
    pool = connection_pool("rediss://u:pw@h:6380/2?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
                           "&ssl_cert_reqs=required", max_connections=3)
    kw = pool.connection_kwargs
    assert pool.connection_class is redis.SSLConnection
    assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == ("h", 6380, 2, "u", "pw")
    assert (kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"], kw["ssl_cert_reqs"]) == (
        "/ca.pem", "/c.pem", "/k.pem", "required")
    assert pool.max_connections == 3


def test_sentinel_pool_asks_the_sentinels_for_the_master():
    pool = connection_pool("rediss+sentinel://:pw@s1:26380/cache/1?sentinel_password=spw&ssl_ca_certs=/ca.pem",
                           socket_timeout=2.0)
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "cache"
    assert pool.connection_class is SentinelManagedSSLConnection
    assert pool.connection_kwargs["password"] == "pw" and pool.connection_kwargs["db"] == 1
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool
    assert sentinel.connection_kwargs["password"] == "spw" and sentinel.connection_kwargs["socket_timeout"] == 2.0
    assert (sentinel.connection_kwargs["host"], sentinel.connection_kwargs["port"]) == ("s1", 26380)


def test_directory_peer_is_masked_for_every_form():
    for url in ["redis://u:hunter2@127.0.0.1:1/0", "redis+sentinel://:hunter2@127.0.0.1:1/svc/0"]:
        directory = KVDirectory(url)
        try:
            assert "hunter2" not in directory.peer and is_sentinel_url(url) == ("sentinel" in directory.peer)
        finally:
            directory.close()
