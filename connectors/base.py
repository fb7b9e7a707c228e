"""The connector contract every transport implements (vLLM's classic KV connector).

Lifecycle: a node builds one connector from its config (`factory.create_connector`),
lets it allocate the KV pool (`allocate_kv_pool`) and hands it the pool's per-layer
views once (`register_kv_caches`), then calls
`send_kv_caches_and_hidden_states` after each prefill forward (prefill role) or
`recv_kv_caches_and_hidden_states` before each prompt forward (decode role), and
finally `close()`. A prefill node also calls `set_release_callback` to learn when
the connector no longer needs a request's blocks (pulled, refused, or expired).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvwire.connectors.types import IntermediateTensors

if TYPE_CHECKING:
    from kvwire.connectors.config import ConnectorConfig
    from kvwire.connectors.wire import KVLayout, KVLocation
    from kvwire.engine.kv_cache import KVPool
    from kvwire.engine.model_input import ModelInput

HiddenStates = torch.Tensor | IntermediateTensors


class TransferError(RuntimeError):
    """A transfer of one request's KV failed; the consumer recomputes it."""

    def __init__(self, request_id: str, peer: str, reason: str):
        super().__init__(f"request {request_id} with peer {peer}: {reason}")
        self.request_id = request_id
        self.peer = peer
        self.reason = reason


class KVConnectorBase(ABC):
    """Moves KV caches and hidden states from prefill nodes to decode nodes."""

    @abstractmethod
    def __init__(self, rank: int, local_rank: int, config: ConnectorConfig):
        """Args:
        rank: global rank of this worker.
        local_rank: rank on this host (picks the device).
        config: the node's connector configuration.
        """

    def allocate_kv_pool(self, layout: KVLayout, num_blocks: int, device: str | torch.device) -> KVPool:
        """Allocate the node's KV pool (once, before `register_kv_caches`).

        Transports whose peers read the pool directly (shared memory, CUDA IPC) override
        this to place it where peers can map it.
        """
        from kvwire.engine.kv_cache import KVPool

        return KVPool.allocate(layout, num_blocks, device)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Called once with the per-layer views of the node's KV pool."""

    @abstractmethod
    def close(self) -> None:
        """Release every buffer, endpoint, thread and directory entry this connector owns."""

    @abstractmethod
    def send_kv_caches_and_hidden_states(
        self,
        model_executable: torch.nn.Module,
        model_input: ModelInput,
        kv_caches: list[torch.Tensor],
        hidden_or_intermediate_states: HiddenStates,
    ) -> None:
        """Publish the KV and hidden states of every request in a prefill batch.

        Args:
            model_executable: the model that produced them.
            model_input: the batch just computed.
            kv_caches: per-layer views `[num_blocks, 2, block_size, kv_heads, head_dim]`.
            hidden_or_intermediate_states: `[num_tokens, hidden]` for the whole batch,
                or IntermediateTensors sliced the same way.
        """

    @abstractmethod
    def recv_kv_caches_and_hidden_states(
        self,
        model_executable: torch.nn.Module,
        model_input: ModelInput,
        kv_caches: list[torch.Tensor],
    ) -> tuple[HiddenStates | None, bool, ModelInput]:
        """Fetch the batch's KV into `kv_caches` and its hidden states, within the deadline.

        Returns:
            `(hidden_or_intermediate_states, bypass_model_exec, model_input)`. bypass is
            True only when every request of the batch received all of its KV and hidden
            states; then the hidden states cover the whole batch. Otherwise hidden is None
            and the returned model_input is what must still be computed.
        """

    def begin_layer_stream(self, model_input: ModelInput, hidden_size: int,
                           hidden_dtype: torch.dtype) -> Callable[[int], None] | None:
        """Producer, before a prompt batch's forward: stream its KV layer by layer?

        Returns:
            What the forward calls with each layer's index once that layer's K and V are
            in the pool (vLLM v1's `save_kv_layer` moment); `send_kv_caches_and_hidden_states`
            then completes the requests, `abort_layer_stream` fails them. None (the default):
            the KV is published after the forward, whole.
        """
        return None

    def abort_layer_stream(self, model_input: ModelInput, reason: str) -> None:
        """Producer: the forward begun after `begin_layer_stream` failed; its consumers recompute."""

    def holds(self, request_id: str) -> bool:
        """Producer: whether the connector holds the request's blocks (the release callback will fire)."""
        return False

    def expect(self, request_id: str, on_ready: Callable[[str], None]) -> None:
        """Consumer: a request whose KV will be received has arrived.

        `on_ready(request_id)` fires, possibly on a connector thread, once its KV can be
        pulled at once or will never come; the node admits the request then, so running
        requests do not wait for it. The KV deadline counts from this call. The default
        fires at once.
        """
        on_ready(request_id)

    def set_located_callback(self, callback: Callable[[KVLocation], None]) -> None:
        """Producer: `callback(location)` runs on the publishing thread once a request's KV can be
        pulled, before the directory has it (the node tells the consumer directly). Default: unused."""

    def kv_located(self, location: KVLocation) -> bool:
        """Consumer: the producer says directly where an expected request's KV is (the directory's
        READY, sooner). Returns whether it was taken; the node then admits the request. Default: no."""
        return False

    def set_release_callback(self, callback: Callable[[str], None]) -> None:
        """Producer: `callback(request_id)` runs, possibly on a connector thread, once the
        connector no longer needs that request's blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not produce KV")
