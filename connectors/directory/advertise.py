"""The address a node publishes for its peers (`--advertise-host`), picked when not given.

A node binds its sockets on `--host` and publishes one address in the directory: its
work endpoint, side channels and TCP / NCCL transport addresses all name it. When
`--host` is one address, that address is the only one the sockets answer on, so it is
the default. When `--host` is a wildcard (0.0.0.0, ::) the node answers on every
interface and must say which one its peers should use; the default is the one the
kernel would send from to reach the directory's Redis: peers find the node through
that Redis, so they share its network. Loopback is never picked for a wildcard (a
peer's 127.0.0.1 is itself): with Redis on this host's loopback, the address of the
default route is used, then the hostname's.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse

from kvwire.connectors.config import WILDCARD_HOSTS
from kvwire.connectors.directory.redis_url import is_sentinel_url, parse_sentinel_url

DEFAULT_REDIS_PORT = 6379
_OUTSIDE = ("198.51.100.1", 9)  # TEST-NET-2 (RFC 5737): only used to ask the kernel for its default route


def advertise_host(host: str, advertise: str | None, redis_url: str) -> str:
    """The address a node publishes (see the module docstring).

    Args:
        host: the bind address (--host).
        advertise: --advertise-host, or None.
        redis_url: the directory's URL; its first host is where the route is looked up.
    Returns:
        An address, never a wildcard, and loopback only when `host` itself is loopback.
    Raises:
        ValueError: an explicit wildcard, or no non-loopback address could be found for a wildcard host.
    """
    if advertise:
        if advertise in WILDCARD_HOSTS:
            raise ValueError(f"advertise host {advertise} is a wildcard: it names no address a peer can connect to")
        return advertise
    if host not in WILDCARD_HOSTS:
        return host
    candidates = [route_source(*directory_address(redis_url)), route_source(*_OUTSIDE), _hostname_address()]
    for found in candidates:
        if found is not None and not ipaddress.ip_address(found).is_loopback:
            return found
    raise ValueError(f"host {host}: found no address other than loopback that peers could reach; "
                     "give an advertise host (--advertise-host; advertise_host with vLLM)")


def directory_address(redis_url: str) -> tuple[str, int]:
    """(host, port) of the directory's Redis: the URL's host, or a Sentinel URL's first sentinel."""
    if is_sentinel_url(redis_url):
        return parse_sentinel_url(redis_url).sentinels[0]
    parts = urllib.parse.urlsplit(redis_url)
    return parts.hostname or "127.0.0.1", parts.port or DEFAULT_REDIS_PORT


def route_source(host: str, port: int) -> str | None:
    """The local address the kernel would send from to reach host:port, or None (no route, unresolvable).

    A connected UDP socket takes its source from the routing table; no packet is sent.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            return str(sock.getsockname()[0])
    except OSError:
        return None


def _hostname_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
