"""Which name a vLLM server's connector takes in kvwire's directory, and which servers it refuses to be.

1. `EngineShape.of(vllm_config)`: the server's parallel shape and vLLM's `engine_id` (a new uuid per
   server unless the user sets one; vLLM appends `_dp<rank>` for each data-parallel engine).
2. `node_id_of`: the directory name of one engine. A `node_id` the user gives is kept across restarts
   (so a restarted server fences what its last incarnation published), with `-dp<rank>` when the server
   runs several data-parallel engines; with none, `vllm-<hostname>-<engine id>`, unique per server, so two
   servers on one host with the minimal config never share a name.
3. `refuse_shape`: tensor and pipeline parallel servers are refused at start-up, loudly: every rank
   would hold only its share of the KV under one name, and every prompt would be recomputed.
4. `refuse_live_duplicate` (the worker, before it registers): a name whose current holder is alive and
   heartbeating is refused, naming that process, instead of silently fencing a live server.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from kvwire.connectors.directory import KVDirectory
from kvwire.connectors.wire import NodeInfo

_UUID = re.compile(r"^([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class EngineShape:
    """One vLLM engine's place in its server: vLLM's engine id and parallel sizes and ranks."""

    engine_id: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    @classmethod
    def of(cls, vllm_config: Any) -> EngineShape:
        p = vllm_config.parallel_config
        return cls(engine_id=str(vllm_config.kv_transfer_config.engine_id),
                   tensor_parallel_size=p.tensor_parallel_size, pipeline_parallel_size=p.pipeline_parallel_size,
                   data_parallel_size=p.data_parallel_size, data_parallel_rank=p.data_parallel_rank)


def node_id_of(given: str, engine: EngineShape, hostname: str) -> str:
    """This engine's name in the directory (see the module docstring)."""
    if given:
        return f"{given}-dp{engine.data_parallel_rank}" if engine.data_parallel_size > 1 else given
    short = _UUID.sub(r"\1", engine.engine_id)  # a uuid's first 8 hex digits name it well enough on one host
    return f"vllm-{hostname}-{short}"


def refuse_shape(engine: EngineShape) -> None:
    """Raises: ValueError for a server shape kvwire would never move KV for."""
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    if tp > 1 or pp > 1:
        raise ValueError(f"kvwire: this vLLM server runs tensor_parallel_size {tp}, pipeline_parallel_size {pp}; "
                         "kvwire's connector moves the KV of TP=1, PP=1 servers only (each data-parallel engine "
                         "is a node of its own): with more ranks every prompt would be recomputed on decode. "
                         "Serve with TP=1 and PP=1, or use another KV connector for this shape")


def refuse_live_duplicate(directory: KVDirectory, node_id: str) -> None:
    """Raises: ValueError when `node_id` is registered by a live process: its registration lives only
    node_ttl_s past its last heartbeat, so one that is there and not draining is a running server."""
    other = directory.get_node(node_id)
    if other is None or other.draining:
        return
    age = f"{max(0.0, time.time() - other.heartbeat_at):.1f} s ago" if other.heartbeat_at else "at an unknown time"
    raise ValueError(f"kvwire: node id {node_id!r} is in use by a live server ({_who(other)}, last heartbeat "
                     f"{age}): give each server its own kv_connector_extra_config node_id (or none: the default "
                     "is unique per server), or stop the other first")


def _who(info: NodeInfo) -> str:
    host = info.host.split("/", 1)[0] or "an unknown host"  # host_identity(): the hostname, then ids of it
    where = info.work_endpoint or f"pid {info.pid or '?'} on {host}"
    return f"{info.engine} {info.role}, {where}, epoch {info.epoch}"


def rank_node_id(server: str, rank: int, tp: int) -> str:
    """The directory name of one tensor-parallel rank of server `server` (the server's own name at TP=1)."""
    return server if tp == 1 else f"{server}-tp{rank}"
