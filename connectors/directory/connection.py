"""The directory's one connection to Redis, shared by its request entries (directory.py) and its node
registry (nodes.py).

The connection pools do not decode replies, so every reply holds bytes; redis-py's annotations
also allow str (a client made with decode_responses=True), hence the casts to `_Fields` and bytes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvwire.connectors.directory import redis_url as redis_url_forms
from kvwire.connectors.directory.scripts import LUA_CLAIM_NODE, LUA_CREATE, LUA_PUBLISH, LUA_PUT_NODE, LUA_TRANSITION
from kvwire.observability.labels import DirectoryOp
from kvwire.observability.metrics import Metrics, process_metrics

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 5.0  # socket timeout of ordinary commands, by default
_BLOCK_SLICE_S = 5.0  # longest single blocking read; longer waits loop
_MAX_CONNECTIONS = 64
_MAX_BLOCKING_CONNECTIONS = 256  # one per concurrent wait_for
_EPOCH_TTL_FACTOR = 10  # an epoch counter outlives every record that names an older epoch
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]+")

_Fields = dict[bytes, bytes]  # a hash's fields, or a stream event's
_StreamEntry = tuple[bytes, _Fields]  # (event id, fields)


class DirectoryError(RuntimeError):
    """The directory could not be reached, or holds a record it cannot read.

    Attributes:
        reason: what went wrong.
        request_id: the request concerned; None for registry operations.
        peer: the Redis URL, password masked.
    """

    def __init__(self, reason: str, *, request_id: str | None = None, peer: str):
        about = f" request {request_id}" if request_id is not None else ""
        super().__init__(f"directory {peer}{about}: {reason}")
        self.reason = reason
        self.request_id = request_id
        self.peer = peer


class StaleNodeError(DirectoryError):
    """A node wrote its NodeInfo with an epoch older than its node id's latest one."""


def _masked(url: str) -> str:
    return redis_url_forms.masked(url)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _timed(op: DirectoryOp):
    """Record the method's duration in kvwire_directory_op_seconds{op}, failures included."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self: DirectoryConnection, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._op_seconds.labels(str(op)).observe(time.perf_counter() - start)
        return timed
    return wrap


class DirectoryConnection:
    """The directory's connection to Redis: pools, scripts, error mapping; thread-safe. KVDirectory is the class
    to make (directory.py), its request entries and node registry over one of these.

    Every method raises DirectoryError when Redis cannot be reached.

    Args:
        redis_url: `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS) or
            `redis+sentinel://...` (connectors/directory/redis_url.py; docs/redis.md).
        entry_ttl_s: TTL of a request's keys, refreshed on every transition.
        node_ttl_s: TTL of a node's registration, refreshed by each heartbeat.
        namespace: prefix of every key, so deployments can share one Redis.
        command_timeout_s: how long one command may wait on a silent Redis before it raises DirectoryError
            (and a connection attempt; a blocking read waits its block on top).
        metrics: where operation latencies go; this process's metrics by default.
    Raises:
        ValueError: a non-positive TTL or timeout, or a namespace outside [A-Za-z0-9_.-].
    """

    def __init__(self, redis_url: str, *, entry_ttl_s: float = 60.0, node_ttl_s: float = 5.0,
                 namespace: str = "kvwire", command_timeout_s: float = COMMAND_TIMEOUT_S,
                 metrics: Metrics | None = None):  # fmt: skip
        if entry_ttl_s <= 0 or node_ttl_s <= 0 or command_timeout_s <= 0:
            raise ValueError(f"TTLs and timeouts must be positive, got entry {entry_ttl_s}, node {node_ttl_s}, "
                             f"command {command_timeout_s}")
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE_RE.pattern}")
        self.entry_ttl_s, self.node_ttl_s, self.namespace = entry_ttl_s, node_ttl_s, namespace
        self.peer = _masked(redis_url)
        self._op_seconds = (metrics or process_metrics()).directory_op_seconds
        self._epoch_ttl_ms = _ms(_EPOCH_TTL_FACTOR * max(entry_ttl_s, node_ttl_s))
        # One retry without backoff replaces a pooled connection broken by a server restart,
        # yet fails fast while the server is down.
        common = dict(retry=Retry(NoBackoff(), 1), socket_connect_timeout=command_timeout_s)
        self._pool = redis_url_forms.connection_pool(
            redis_url, max_connections=_MAX_CONNECTIONS, socket_timeout=command_timeout_s, **common)
        # Blocking reads hold a connection for their whole wait: a pool of their own, whose
        # socket timeout exceeds the longest block.
        self._blocking_pool = redis_url_forms.connection_pool(
            redis_url, max_connections=_MAX_BLOCKING_CONNECTIONS,
            socket_timeout=_BLOCK_SLICE_S + command_timeout_s, **common)  # fmt: skip
        self._redis = redis.Redis(connection_pool=self._pool)
        self._blocking = redis.Redis(connection_pool=self._blocking_pool)
        self._create = self._redis.register_script(LUA_CREATE)
        self._publish = self._redis.register_script(LUA_PUBLISH)
        self._transition = self._redis.register_script(LUA_TRANSITION)
        self._put_node = self._redis.register_script(LUA_PUT_NODE)
        self._claim_node = self._redis.register_script(LUA_CLAIM_NODE)
        self._load_scripts()

    def _load_scripts(self) -> None:
        """Load the scripts now (one round trip), so pipelined EVALSHAs find them; best effort: a server
        that is down, or forgets them later, answers NOSCRIPT and the step is re-run (batch.py)."""
        scripts = (self._create, self._publish, self._transition, self._put_node, self._claim_node)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for script in scripts:
                pipe.script_load(script.script)
            pipe.execute()
        except redis.RedisError as exc:
            logger.debug("directory %s: scripts not loaded yet: %s", self.peer, exc)

    def _entry_keys(self, request_id: str) -> list[str]:
        return [f"{self.namespace}:req:{request_id}", f"{self.namespace}:ev:{request_id}"]

    def _node_keys(self, node_id: str) -> list[str]:
        return [f"{self.namespace}:node:{node_id}", f"{self.namespace}:epoch:{node_id}"]

    @contextlib.contextmanager
    def _errors(self, what: str, request_id: str | None = None) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            reason = f"{what}: {type(exc).__name__}: {exc}"
            raise DirectoryError(reason, request_id=request_id, peer=self.peer) from exc

    def close(self) -> None:
        """Close every pooled connection; the directory is not to be used afterwards."""
        self._pool.disconnect()
        self._blocking_pool.disconnect()
