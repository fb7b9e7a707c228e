"""Redis URLs of the directory: plain, password, ACL user, TLS, and Sentinel; turned into connection pools.

Forms (docs/redis.md has the details):

    redis://[[user]:password@]host[:port][/db][?query]        plain TCP
    rediss://[[user]:password@]host[:port][/db][?query]       TLS; query: ssl_ca_certs, ssl_certfile,
                                                              ssl_keyfile, ssl_cert_reqs, ssl_check_hostname
    redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2]...]/service[/db][?query]
    rediss+sentinel://...                                     the same, TLS to the sentinels and the master

The credentials in a Sentinel URL are the master's; the sentinels' own come as the query
parameters `sentinel_username` / `sentinel_password`. Plain and TLS URLs go to
redis-py's `ConnectionPool.from_url` unchanged (it passes the ssl_* query parameters
through); Sentinel URLs are parsed here into a `Sentinel` and a pool that asks it for
the current master before each new connection, so a failover needs no restart.
`masked` hides every password, for logs and errors.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
_SSL_PARAMS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
_SENTINEL_AUTH_PARAMS = {"sentinel_username", "sentinel_password"}


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed Sentinel URL.

    Attributes:
        sentinels: (host, port) of each sentinel.
        service: the monitored master's name.
        master_kwargs: connection settings for the master (db, credentials, TLS).
        sentinel_kwargs: connection settings for the sentinels (credentials, TLS).
    """

    sentinels: list[tuple[str, int]]
    service: str
    master_kwargs: dict[str, Any] = field(default_factory=dict)
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)


def masked(url: str) -> str:
    """`url` with its password, and every `*password*` query parameter, replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if sep:
        end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        userinfo, at, hosts = rest[:end].rpartition("@")
        if at and ":" in userinfo:
            rest = f"{userinfo.partition(':')[0]}:***@{hosts}{rest[end:]}"
    out = f"{scheme}{sep}{rest}"
    head, sep, query = out.partition("?")
    if not sep:
        return out
    pairs = [(k, "***" if "password" in k.lower() else v)
             for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)]
    return head + "?" + urllib.parse.urlencode(pairs, safe="/*")


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse `redis+sentinel://` / `rediss+sentinel://` (see the module docstring).

    Raises:
        ValueError: not a Sentinel URL, no host, no service name, a bad port or db, or an unknown query parameter.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL: {masked(url)}")
    tls = SENTINEL_SCHEMES[scheme.lower()]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    service, _, db = path.strip("/").partition("/")
    if not hosts or not service:
        raise ValueError(f"Sentinel URL needs host[:port][,host[:port]...]/service: {masked(url)}")
    auth = _credentials(userinfo)
    params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    unknown = set(params) - _SSL_PARAMS - _SENTINEL_AUTH_PARAMS
    if unknown:
        raise ValueError(f"unsupported query parameters {sorted(unknown)} in {masked(url)}")
    ssl = {"ssl": True, **{k: _ssl_value(k, v) for k, v in params.items() if k in _SSL_PARAMS}} if tls else {}
    if not tls and set(params) & _SSL_PARAMS:
        raise ValueError(f"ssl_* parameters need rediss+sentinel://: {masked(url)}")
    sentinel_auth = {k.removeprefix("sentinel_"): v for k, v in params.items() if k in _SENTINEL_AUTH_PARAMS}
    return SentinelTarget(sentinels=[_host_port(h, url) for h in hosts.split(",")], service=service,
                          master_kwargs={"db": _db(db, url), **auth, **ssl}, sentinel_kwargs={**sentinel_auth, **ssl})


def connection_pool(url: str, **kwargs: Any) -> redis.ConnectionPool:
    """A connection pool for any URL form above.

    Args:
        url: the directory's Redis URL.
        kwargs: pool and connection settings (max_connections, socket_timeout, retry, ...), which win
            over the URL's; Sentinel pools use the socket timeouts and retry for the sentinels too.
    Raises:
        ValueError: a malformed URL.
    """
    if not is_sentinel_url(url):
        return redis.ConnectionPool.from_url(url, **kwargs)
    target = parse_sentinel_url(url)
    shared = ("socket_timeout", "socket_connect_timeout", "retry")
    for_sentinels: dict[str, Any] = {k: kwargs[k] for k in shared if k in kwargs}
    sentinel = Sentinel(target.sentinels, sentinel_kwargs={**for_sentinels, **target.sentinel_kwargs})
    return SentinelConnectionPool(target.service, sentinel, **{**target.master_kwargs, **kwargs})


def _credentials(userinfo: str) -> dict[str, str]:
    if not userinfo:
        return {}
    user, has_password, password = userinfo.partition(":")
    out = {"username": urllib.parse.unquote(user)} if user else {}
    if has_password:
        out["password"] = urllib.parse.unquote(password)
    return out


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [ipv6]:port
        host, _, port = item[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    if not host:
        raise ValueError(f"empty sentinel host in {masked(url)}")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port {port!r} in {masked(url)}")
    return host, int(port)


def _db(text: str, url: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"bad database number {text!r} in {masked(url)}")
    return int(text)


def _ssl_value(name: str, value: str) -> Any:
    if name == "ssl_check_hostname":
        return value.lower() in ("1", "true", "yes", "on")
    return value
