"""Which name a vLLM server's connector takes in kvwire's directory, and which servers it refuses to be.

1. `EngineShape.of(vllm_config)`: the server's parallel shape, its model's KV heads, and vLLM's
   `engine_id` (a new uuid per server unless the user sets one; vLLM appends `_dp<rank>` for each
   data-parallel engine); a worker adds its tensor-parallel rank.
2. `node_id_of`: the directory name of one engine. A `node_id` the user gives is kept across restarts
   (so a restarted server fences what its last incarnation published), with `-dp<rank>` when the server
   runs several data-parallel engines; with none, `vllm-<hostname>-<engine id>`, unique per server, so two
   servers on one host with the minimal config never share a name. `rank_node_id`: each tensor-parallel
   rank's worker is a node of its own, `<engine's name>-tp<rank>` (the engine's name at TP=1).
3. `refuse_shape`: pipeline-parallel servers are refused at start-up, loudly (a stage holds only its
   layers' KV, and kvwire does not gather stages).
4. `claim_node_id` (the worker, before it registers): a name whose current holder is alive and heartbeating
   is refused, naming that process, instead of silently fencing a live server; the check and the taking of
   the name are one atomic step, so of two servers started under one name at the same instant one serves.
5. `checkpoint_of` (the worker): which checkpoint its KV is of (connectors/checkpoint.py), from the model's
   files where they are found (its directory, or the Hugging Face cache vLLM loaded it from), else from
   its name and revision as vLLM's NIXL connector does; a consumer refuses KV of another.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwire.connectors.checkpoint import model_fingerprint, name_fingerprint
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import NodeInfo, kv_quant_of

log = logging.getLogger(__name__)
_DP_SUFFIX = re.compile(r"_dp\d+$")  # what vLLM appends to each data-parallel engine's engine_id
_UUID = re.compile(r"^([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# quantized KV caches whose blocks hold every byte of their values (scales, if any, per layer from the checkpoint)
MOVED_QUANT = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineShape:
    """One vLLM engine's place in its server: vLLM's engine id and parallel sizes and ranks."""

    engine_id: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel: bool = False  # one of a server's several data-parallel engines
    data_parallel_rank: int = 0
    tensor_rank: int = 0  # a worker's; 0 in the scheduler
    kv_heads: int = 1  # the model's KV heads, all ranks together (MLA: its one latent)
    mla: bool = False
    kv_quant: str = ""  # a quantized KV cache's --kv-cache-dtype (KVLayout.kv_quant); "": the model's dtype

    @classmethod
    def of(cls, vllm_config: Any, tensor_rank: int = 0) -> EngineShape:
        p, model = vllm_config.parallel_config, vllm_config.model_config
        mla = bool(model is not None and model.use_mla)
        heads = 1 if model is None or mla else model.get_total_num_kv_heads()
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        # vLLM runs a dense model's data-parallel engines as independent DP=1 engines (data_parallel_size 1, rank
        # 0: ParallelConfig.reconfigure_for_independent_dp_rank); the engine id's `_dp<rank>` suffix, which vLLM
        # gives every engine of a DP server, and data_parallel_index still tell the engine's place
        data_parallel = p.data_parallel_size > 1 or _DP_SUFFIX.search(engine_id) is not None
        rank = getattr(p, "data_parallel_index", p.data_parallel_rank)
        cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
        return cls(engine_id=engine_id, tensor_parallel_size=p.tensor_parallel_size,
                   pipeline_parallel_size=p.pipeline_parallel_size, data_parallel=data_parallel,
                   data_parallel_rank=rank, tensor_rank=tensor_rank, kv_heads=heads, mla=mla,
                   kv_quant=kv_quant_of(cache_dtype))


def node_id_of(given: str, engine: EngineShape, hostname: str) -> str:
    """This engine's name in the directory (see the module docstring)."""
    if given:
        return f"{given}-dp{engine.data_parallel_rank}" if engine.data_parallel else given
    short = _UUID.sub(r"\1", engine.engine_id)  # a uuid's first 8 hex digits name it well enough on one host
    return f"vllm-{hostname}-{short}"


def refuse_shape(engine: EngineShape) -> None:
    """Raises: ValueError for a server shape kvwire would never move KV for."""
    if engine.kv_quant and engine.kv_quant not in MOVED_QUANT:
        raise ValueError(f"kvwire: this vLLM server's KV cache is {engine.kv_quant}, whose scales live apart from "
                         f"its blocks; kvwire moves KV caches of the model's dtype or of {', '.join(MOVED_QUANT)} "
                         "(--kv-cache-dtype)")
    pp = engine.pipeline_parallel_size
    if pp > 1:
        raise ValueError(f"kvwire: this vLLM server runs pipeline_parallel_size {pp}; kvwire's connector moves "
                         "the KV of PP=1 servers only (tensor- and data-parallel ones included): a stage holds "
                         "only its own layers. Serve with PP=1 (use tensor parallel), or another KV connector")


def claim_node_id(directory: KVDirectory, node_id: str, wait_s: float = 0.0) -> int:
    """Take `node_id` for this worker, in one atomic step with the check that no live server holds it
    (`KVDirectory.claim_node`: a registration lives only node_ttl_s past its last heartbeat, so one that is there
    and not draining is a running server). Returns this incarnation's epoch.

    `wait_s`: how long a Redis that does not answer yet is waited for (`KVDirectory.first_claim`).

    Raises: ValueError naming the live holder (or the server whose start claimed it a moment ago); DirectoryError
    for a Redis that does not answer within `wait_s`."""
    epoch, other = directory.first_claim(node_id, wait_s)
    if epoch:
        return epoch
    advice = ("give each server its own kv_connector_extra_config node_id (or none: the default is unique per "
              "server), or stop the other first")
    if other is None:
        raise ValueError(f"kvwire: node id {node_id!r} was claimed a moment ago by another server starting under "
                         f"it: {advice}")
    age = f"{max(0.0, time.time() - other.heartbeat_at):.1f} s ago" if other.heartbeat_at else "at an unknown time"
    raise ValueError(f"kvwire: node id {node_id!r} is in use by a live server ({_who(other)}, last heartbeat "
                     f"{age}): {advice}")


def _who(info: NodeInfo) -> str:
    host = info.host.split("/", 1)[0] or "an unknown host"  # host_identity(): the hostname, then ids of it
    where = info.work_endpoint or f"pid {info.pid or '?'} on {host}"
    return f"{info.engine} {info.role}, {where}, epoch {info.epoch}"


def rank_node_id(server: str, rank: int, tp: int) -> str:
    """The directory name of one tensor-parallel rank of server `server` (the server's own name at TP=1)."""
    return server if tp == 1 else f"{server}-tp{rank}"


def checkpoint_of(model: str, revision: str | None) -> str:
    """The fingerprint of vLLM's `model_config.model` at `revision` (see the module docstring)."""
    path: Path | None = Path(model)
    if not Path(model).is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - not a hub id, or not in the cache: the name stands for it
            path = None
    if path is not None:
        try:
            fingerprint = model_fingerprint(path)
            log.info("kvwire: model %s is checkpoint %s (from its files in %s)", model, fingerprint, path)
            return fingerprint
        except (OSError, ValueError) as exc:
            log.info("kvwire: model %s: its files say nothing (%s); its name stands for it", model, exc)
    return name_fingerprint(model, revision)
