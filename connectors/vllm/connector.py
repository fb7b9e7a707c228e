"""`KvwireConnector`: vLLM's V1 KV connector interface over kvwire's halves.

vLLM builds one connector per role: in the scheduler (`KVConnectorRole.SCHEDULER`, the
`SchedulerHalf` decides what to pull and hold) and in each worker (`WORKER`, the
`WorkerHalf` moves the bytes). This class only routes vLLM's calls to them.

kvwire is `SupportsHMA`: vLLM keeps its hybrid KV cache manager on, and a model of several KV
cache groups (sliding-window beside full attention) hands per-group block lists (groups.py).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvwire.connectors.vllm.groups import Groups
from kvwire.connectors.vllm.identity import EngineShape, checkpoint_of
from kvwire.connectors.vllm.metadata import KvwireMetadata
from kvwire.connectors.vllm.scheduler import SchedulerHalf
from kvwire.connectors.vllm.settings import VLLMSettings
from kvwire.connectors.vllm.stats import KvwirePromMetrics, KvwireStats
from kvwire.connectors.vllm.worker import IDLE_WAIT_S, WorkerHalf

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KvwireConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        transfer = self._kv_transfer_config
        rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        self.settings = VLLMSettings.parse(transfer.kv_role, transfer.kv_connector_extra_config or {},
                                           EngineShape.of(vllm_config, rank))
        _insist_on_recompute(transfer)
        self._groups = Groups.of(kv_cache_config)
        self._groups.check_ranks(self.settings.engine.tensor_parallel_size)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            _warn_if_no_drain(vllm_config, self.settings)
            self._scheduler = SchedulerHalf(self.settings, self._groups)
        else:
            self._worker = WorkerHalf(self.settings, kv_cache_config.num_blocks, self._groups.block_size)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM's KV cache layout kvwire needs: "LBHNC" (as NIXL asks), None for MLA models.

        In LBHNC one KV head of one block is one contiguous run of memory, so tensor-parallel peers
        move head slices without repacking (layout.py refuses the others). vLLM's default for
        FlashAttention and Triton, LBNHC, interleaves the heads token by token. MLA caches hold one
        latent "head", which every layout stores the same way, so kvwire leaves vLLM its choice.
        """
        if vllm_config.model_config is None:
            return None
        return None if vllm_config.model_config.use_mla else "LBHNC"

    # --- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_metadata(scheduler_output.num_scheduled_tokens)
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)

    # --- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        assert self._worker is not None
        planes = self._groups.planes(kv_caches)  # attention layers' views (a state layer's share their pages)
        backends = get_current_attn_backends(self._vllm_config, list(planes))
        if len(backends) != 1:
            raise ValueError(f"kvwire moves KV of one attention backend per model; this one has "
                             f"{[b.get_name() for b in backends]}")
        model = self._vllm_config.model_config
        self._worker.register(planes, backends[0], checkpoint_of(model.model, model.revision) if model else "")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwireMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Pulls land between steps (vLLM parks the request meanwhile): nothing to wait for here."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Consumers pull from vLLM's own KV tensors once the prompt is done: nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing is saved (see save_kv_layer)."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KvwireMetadata) and meta.idle
        sent, received, failed = self._worker.transfer_results(IDLE_WAIT_S if idle else 0.0)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    # --- stats (vLLM's /metrics: stats.py) --------------------------------------------------

    def get_kv_connector_stats(self) -> KvwireStats | None:
        half = self._worker or self._scheduler
        data = half.tally.take() if half is not None else None
        return None if data is None else KvwireStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvwireStats:
        return KvwireStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvwirePromMetrics:
        return KvwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


def _log_like_vllm() -> None:
    """kvwire's log lines go where vLLM's go, in its format (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("kvwire"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def _warn_if_no_drain(vllm_config: VllmConfig, settings: VLLMSettings) -> None:
    """A prefill server stopped (SIGTERM) with vLLM's default --shutdown-timeout 0 aborts at once, and the KV it
    holds for decode servers goes with it: each of those prompts is computed again there (counted). With a
    timeout, vLLM steps on while requests' KV is held (delayed free) and kvwire serves their pulls first."""
    if settings.role.produces and not getattr(vllm_config, "shutdown_timeout", 0):
        log.warning("kvwire: --shutdown-timeout is 0: when this server is stopped, the KV it holds for decode "
                    "servers is dropped and they compute those prompts again; give it --shutdown-timeout %d (the "
                    "KV's hold, kv_deadline_s) to let them pull it first", math.ceil(settings.kv_deadline_s))


def _insist_on_recompute(transfer: Any) -> None:
    """kvwire's promise is that a failed transfer is recomputed, never a failed request. vLLM's default
    `kv_load_failure_policy` is "fail" (and vLLM cannot tell a default from a choice), so it becomes
    "recompute" here, with a warning."""
    if transfer.kv_load_failure_policy != "recompute":
        log.warning("kvwire: kv_load_failure_policy %r -> 'recompute': a prompt whose KV does not arrive is "
                    "recomputed, never failed", transfer.kv_load_failure_policy)
        transfer.kv_load_failure_policy = "recompute"
