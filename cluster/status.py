"""What `kvwire status` shows: the directory's live nodes and request entries, as structs, a table or JSON."""

from __future__ import annotations

import time

import msgspec

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import AgedEntry, KVDirectory, TransferState
from kvwire.connectors.wire import NodeEngine, NodeInfo, TransportCheck, models_agree
from kvwire.observability.labels import RecomputeReason, TransferFailure


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One live node, as its last heartbeat described it."""

    node_id: str
    role: NodeRole
    address: str  # zmq work endpoint; a vLLM server's rank: "vllm pid P on HOST"
    connector: ConnectorKind
    epoch: int
    queue_depth: int
    running: int
    free_blocks: int
    total_blocks: int
    heartbeat_age_s: float | None  # None: the node's heartbeats carry no time (an older node)
    draining: bool = False  # shutting down: finishing what it holds, taking no new work
    transport_checks: list[TransportCheck] = []  # its start-up self-test (empty: an older node)
    engine: NodeEngine = NodeEngine.KVWIRE
    pulls: int = 0  # a consumer's pulls so far (a decode node, a vLLM consumer rank)
    recomputed: dict[TransferFailure, int] = {}  # ... and the prompts it recomputed instead, by reason
    prefix_misses: int = 0  # a decode node's prompts kept on it as cached that it computed again (not in its cache)
    model: str = ""  # its checkpoint's fingerprint ("": not known); a prefill and a decode node of two trade no KV
    settling: int = 0  # a producer's failed pulls whose blocks stay held until their sends settle (0: an older node)


class TransferStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One request entry still in the directory (consumed entries are deleted at once)."""

    request_id: str
    state: TransferState
    producer: str
    age_s: float  # since the entry was created
    reason: str = ""  # why it failed, when it did


class ClusterStatus(msgspec.Struct, frozen=True, kw_only=True):
    directory: str  # the Redis URL, password masked
    nodes: list[NodeStatus]
    transfers: list[TransferStatus]


def node_status(info: NodeInfo, now: float) -> NodeStatus:
    age = max(0.0, now - info.heartbeat_at) if info.heartbeat_at else None
    address = info.work_endpoint or f"{info.engine} pid {info.pid} on {info.host.split('/', 1)[0] or '?'}"
    return NodeStatus(node_id=info.node_id, role=info.role, address=address, connector=info.connector,
                      epoch=info.epoch, queue_depth=info.queue_depth, running=info.running,
                      free_blocks=info.free_blocks, total_blocks=info.total_blocks, heartbeat_age_s=age,
                      draining=info.draining, transport_checks=info.transport_checks, engine=info.engine,
                      pulls=info.pulls, recomputed=info.recomputed, prefix_misses=info.prefix_misses,
                      model=info.model, settling=info.settling)


def transfer_status(aged: AgedEntry) -> TransferStatus:
    e = aged.entry
    return TransferStatus(request_id=e.request_id, state=e.state, producer=e.producer, age_s=aged.age_s,
                          reason=e.reason)


def read_status(directory: KVDirectory, now: float | None = None) -> ClusterStatus:
    """Read the live nodes and request entries (read-only).

    Args:
        now: wall-clock time heartbeat ages are measured against; time.time() by default.
    Raises:
        DirectoryError: the directory cannot be reached.
    """
    now = time.time() if now is None else now
    nodes = [node_status(info, now) for info in directory.live_nodes(include_draining=True, engine=None)]
    transfers = [transfer_status(aged) for aged in directory.entries_with_age()]
    return ClusterStatus(directory=directory.peer, nodes=nodes, transfers=transfers)


def to_json(status: ClusterStatus) -> str:
    return msgspec.json.encode(status).decode()


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [headers, *rows]]


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _paths(checks: list[TransportCheck]) -> str:
    """The self-test per transport: "ucx:sysv/cma", "shm:shm ucx:tcp", "ucx:FAILED"; "-" if none."""
    return " ".join(f"{c.transport}:{c.path if c.ok else 'FAILED'}" for c in checks) or "-"


def _kv(n: NodeStatus) -> list[str]:
    """PULLS, RECOMPUTED: a consumer's, a decode node or a vLLM consumer rank ("deadline:2 producer:1"; "0"; a
    decode node's prefix misses as "prefix_miss:N"); "-" for producers."""
    if n.role == NodeRole.PREFILL:
        return ["-", "-"]
    counts = [*sorted(n.recomputed.items()), (RecomputeReason.PREFIX_MISS, n.prefix_misses)]
    return [str(n.pulls), " ".join(f"{r}:{c}" for r, c in counts if c) or "0"]


def _load(n: NodeStatus) -> list[str]:
    """QUEUED, RUNNING (a producer's settling pulls as "3 +1 settling"), FREE BLOCKS; a vLLM server's rank knows
    its pool's size only (vLLM's own /metrics has the rest)."""
    settling = f" +{n.settling} settling" if n.settling else ""
    if n.engine == NodeEngine.VLLM:
        return ["-", f"-{settling}", f"-/{n.total_blocks}"]
    return [str(n.queue_depth), f"{n.running}{settling}", f"{n.free_blocks}/{n.total_blocks}"]


def _unpaired(nodes: list[NodeStatus]) -> list[str]:
    """A warning line for each live consumer no live producer can hand KV to: they serve other checkpoints."""
    producers = [n for n in nodes if n.role == NodeRole.PREFILL]
    return [f"WARNING: {n.node_id} serves checkpoint {n.model}, no live prefill node does: its prompts are computed "
            "there, never received" for n in nodes
            if n.role != NodeRole.PREFILL and producers and not any(models_agree(p.model, n.model) for p in producers)]


def render(status: ClusterStatus) -> str:
    """The status as two plain-text tables: live nodes, then request entries."""
    node_rows = [[n.node_id, f"{n.role} (draining)" if n.draining else str(n.role), n.address, str(n.connector),
                  str(n.epoch), *_load(n), _age(n.heartbeat_age_s), _paths(n.transport_checks), *_kv(n), n.model or "-"]
                 for n in status.nodes]
    transfer_rows = [[t.request_id, str(t.state), t.producer, _age(t.age_s), t.reason] for t in status.transfers]
    lines = [f"directory {status.directory}", "", f"nodes ({len(status.nodes)} live)"]
    headers = ["NODE", "ROLE", "ADDRESS", "CONNECTOR", "EPOCH", "QUEUED", "RUNNING", "FREE BLOCKS", "HEARTBEAT",
               "TRANSPORT PATH", "PULLS", "RECOMPUTED", "MODEL"]
    lines += _table(headers, node_rows) if node_rows else ["  (none)"]
    lines += _unpaired(status.nodes)
    lines += ["", f"transfers ({len(status.transfers)} in the directory)"]
    lines += _table(["REQUEST", "STATE", "PRODUCER", "AGE", "REASON"], transfer_rows) if transfer_rows else ["  (none)"]
    return "\n".join(lines)
