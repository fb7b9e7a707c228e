"""`kv_connector_extra_config` read once into a frozen `VLLMSettings`, and the kvwire config it implies.

Users configure the connector as they configure NIXL:

    --kv-transfer-config '{"kv_connector": "KvwireConnector",
                           "kv_connector_module_path": "kvwire.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"redis_url": "redis://HOST:6379/0", "transport": "auto"}}'

Unknown keys and bad values are refused when vLLM starts, naming the key.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.control.auth import read_secret_file
from kvwire.connectors.directory.advertise import advertise_host
from kvwire.connectors.vllm.identity import EngineShape, node_id_of, rank_node_id, refuse_shape
from kvwire.connectors.vllm.tp import TPSplit


class KVRole(enum.StrEnum):
    """vLLM's `kv_role`."""

    PRODUCER = "kv_producer"  # prefill: holds what it computed until a consumer pulls it
    CONSUMER = "kv_consumer"  # decode: pulls prompts' KV instead of computing it
    BOTH = "kv_both"  # either, per request (the proxy's kv_transfer_params say which)

    @property
    def produces(self) -> bool:
        return self != KVRole.CONSUMER

    @property
    def consumes(self) -> bool:
        return self != KVRole.PRODUCER


@dataclass(frozen=True)
class VLLMSettings:
    """The connector's settings.

    Attributes:
        role: vLLM's kv_role.
        redis_url: kvwire's directory.
        transport: how KV moves (any kvwire transport name); auto: read straight from a prefill server on this host
            (CUDA IPC on GPUs, cross-memory attach on the CPU), UCX from the rest.
        node_id: this engine's name in the directory (identity.py); a restart under the same name fences
            off what the earlier incarnation published. Default: `vllm-<hostname>-<engine id>`, unique per
            server; a given one gets `-dp<rank>` on a data-parallel server.
        host: the address this instance's transfer servers bind (a wildcard, 0.0.0.0, needs advertise_host
            or picks the source address of the route to Redis: connectors/directory/advertise.py).
        advertise_host: the address peers reach them at, published in the directory; "": as picked above.
        kv_deadline_s: consumer: how long a request waits for its KV before it is recomputed;
            producer: how long computed KV is held for a consumer that has not pulled it.
        entry_ttl_s: TTL of every directory key of a request.
        directory_wait_s: at start, how long a worker waits for a Redis that does not answer yet (started beside
            the server, or restarting) before the server fails.
        pull_lanes: consumer threads moving one pull's pieces (host pools).
        engine: the server's shape (and, in a worker, its tensor-parallel rank).
        auth_secret: what seals every control message of the connector (side channels, shared-memory hand-offs),
            read from `auth_secret_file` as kvwire's nodes read `--auth-secret-file`; None: not sealed.
    """

    role: KVRole
    redis_url: str
    transport: ConnectorKind = ConnectorKind.AUTO
    node_id: str = ""
    host: str = "127.0.0.1"
    advertise_host: str = ""
    kv_deadline_s: float = 30.0
    entry_ttl_s: float = 120.0
    directory_wait_s: float = 60.0
    pull_lanes: int = 2
    engine: EngineShape = EngineShape("")
    auth_secret: bytes | None = field(default=None, repr=False)

    @property
    def rank_node_id(self) -> str:
        """This worker's name in the directory: `node_id`, with its tensor-parallel rank when TP > 1."""
        return rank_node_id(self.node_id, self.engine.tensor_rank, self.engine.tensor_parallel_size)

    @property
    def split(self) -> TPSplit:
        """How this server splits the model's KV heads over its tensor-parallel ranks."""
        return TPSplit(self.engine.kv_heads, self.engine.tensor_parallel_size)

    @classmethod
    def parse(cls, kv_role: str | None, extra: dict[str, Any], engine: EngineShape) -> VLLMSettings:
        """Raises: ValueError naming the key that is missing, unknown or malformed, or a server shape kvwire
        does not serve (identity.py)."""
        refuse_shape(engine)
        known = {"redis_url", "transport", "node_id", "host", "advertise_host", "kv_deadline_s", "entry_ttl_s",
                 "auth_secret_file", "pull_lanes", "directory_wait_s"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvwire: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        if not isinstance(extra.get("redis_url"), str):
            raise ValueError("kvwire: kv_connector_extra_config needs \"redis_url\": \"redis://HOST:PORT/DB\"")
        role = _enum(KVRole, kv_role, "kv_role")
        transport = _enum(ConnectorKind, extra.get("transport", "auto"), "transport")
        node_id = node_id_of(str(extra.get("node_id") or ""), engine, socket.gethostname())
        try:
            numbers = {k: float(extra[k]) for k in ("kv_deadline_s", "entry_ttl_s", "directory_wait_s")
                       if k in extra}
            lanes = int(extra.get("pull_lanes", 2))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kvwire: a numeric kv_connector_extra_config value is malformed: {exc}") from None
        if numbers.get("directory_wait_s", 0.0) < 0:
            raise ValueError(f"kvwire: directory_wait_s must not be negative, got {numbers['directory_wait_s']}")
        host = str(extra.get("host", "127.0.0.1"))
        advertised = advertise_host(host, str(extra.get("advertise_host") or "") or None, extra["redis_url"])
        secret = read_secret_file(Path(str(extra["auth_secret_file"]))) if extra.get("auth_secret_file") else None
        settings = cls(role, extra["redis_url"], transport, node_id, host, advertised, pull_lanes=lanes, engine=engine,
                       auth_secret=secret, **numbers)
        settings.split  # noqa: B018 - refuses a head count that does not split over the ranks, now
        settings.connector_config()  # the checks ConnectorConfig makes, now rather than at the first request
        return settings

    def connector_config(self) -> ConnectorConfig:
        """The kvwire transfer-plane config of this instance's worker."""
        return ConnectorConfig(kind=self.transport, role=NodeRole.PREFILL if self.role.produces else NodeRole.DECODE,
                               node_id=self.rank_node_id, redis_url=self.redis_url, host=self.host,
                               advertise_host=self.advertise_host,
                               kv_deadline_s=self.kv_deadline_s, entry_ttl_s=self.entry_ttl_s,
                               pull_lanes=self.pull_lanes)


def _enum(cls: type[enum.StrEnum], value: object, key: str):
    try:
        return cls(str(value))
    except ValueError:
        raise ValueError(f"kvwire: {key} {value!r} is not one of {[str(m) for m in cls]}") from None
