"""Configuration of the transfer plane, built once in `cli/` and passed down whole."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ConnectorKind(enum.StrEnum):
    """Transports a node can use to move KV."""

    UCX = "ucx"
    AUTO = "auto"  # shared memory with peers on this host, UCX with the others
    TCP = "tcp"
    SHM = "shm"
    NCCL = "nccl"


class NodeRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


MAX_PULL_LANES = 16
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})  # bind addresses that name every interface, never a peer's
LAYERWISE_KINDS = frozenset({ConnectorKind.TCP, ConnectorKind.UCX})  # send engines that stream layer by layer


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything a connector needs to know about its node.

    Attributes:
        kind: which transport.
        role: prefill nodes produce KV, decode nodes consume it.
        node_id: this node's name in the directory.
        redis_url: the directory's Redis.
        host: address the node's sockets bind (work socket, side channel, data listeners); may be a
            wildcard (0.0.0.0, ::) when advertise_host is set.
        advertise_host: the address peers reach this node at, published in the directory (work endpoint,
            side channel, TCP and NCCL transport addresses); "": host itself.
            connectors/directory/advertise.py picks it.
        kv_deadline_s: how long a consumer waits for a request's KV before recomputing.
        entry_ttl_s: TTL on every directory key of a request; held KV is released after it.
        verify_kv: producer: publish a crc32 per layer; consumer: require and check them (a mismatch recomputes).
        pull_lanes: consumer: threads that move one pull's pieces in parallel, on host pools: UCX workers
            polled by a thread each (connectors/transports/ucx/lanes.py), shared-memory copies
            (connectors/transports/shm/copier.py);
            1: the engine thread alone.
        layerwise: producer: publish each prompt's KV before its forward and send it layer by layer as
            the layers are computed (connectors/producer/layer_gate.py); tcp and ucx only, and not with verify_kv
            (the checksums would come after the bytes).
        require_fast_path: consumer: refuse (and recompute) a same-host producer's KV whose path crosses the
            network stack where shared memory was expected (connectors/consumer/fast_path.py); off: warn once per
            producer.
    """

    kind: ConnectorKind
    role: NodeRole
    node_id: str
    redis_url: str
    host: str = "127.0.0.1"
    advertise_host: str = ""
    kv_deadline_s: float = 10.0
    entry_ttl_s: float = 60.0
    verify_kv: bool = False
    pull_lanes: int = 2
    layerwise: bool = False
    require_fast_path: bool = False

    @property
    def advertised_host(self) -> str:
        """The address every endpoint this node publishes names."""
        return self.advertise_host or self.host

    def __post_init__(self) -> None:
        if self.advertised_host in WILDCARD_HOSTS:
            raise ValueError(f"{self.node_id}: peers cannot reach the wildcard address {self.advertised_host!r}; "
                             "give an advertise host")
        if self.layerwise and self.kind not in LAYERWISE_KINDS:
            raise ValueError(f"layer-wise streaming runs over the tcp and ucx connectors, not {self.kind}")
        if self.layerwise and self.verify_kv:
            raise ValueError("layer-wise streaming cannot publish KV checksums before the forward (verify_kv)")
        if not 1 <= self.pull_lanes <= MAX_PULL_LANES:
            raise ValueError(f"pull_lanes must be 1..{MAX_PULL_LANES}, got {self.pull_lanes}")
        if self.kv_deadline_s <= 0:
            raise ValueError(f"kv_deadline_s must be positive, got {self.kv_deadline_s}")
        if self.entry_ttl_s < self.kv_deadline_s:
            raise ValueError("entry_ttl_s must be at least kv_deadline_s")
