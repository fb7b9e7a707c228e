"""The connector contract the engine's runner calls (vLLM's classic KV connector).

1. A node builds its role (producer/role.py or consumer/role.py) over its transport and pool, and
   the contract's face for that role (connector.py) around it.
2. The runner hands it the pool's per-layer views once (`register_kv_caches`).
3. Prefill: `send_kv_caches_and_hidden_states` after each prompt forward (or, when the
   producer streams layer by layer, `begin_layer_stream` before it and
   `abort_layer_stream` if it fails). Decode: `recv_kv_caches_and_hidden_states` before
   each prompt forward, which is skipped when it returns bypass; `after_step` once a
   step's outputs are out (a consumer then tells producers what it read with no round trip
   a little earlier, so they release those blocks: shared memory), `after_step(idle=True)`
   before the engine waits for work (then all of it).
4. `close()` stops the role's threads and transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvwire.connectors.types import IntermediateTensors

if TYPE_CHECKING:
    from kvwire.connectors.config import ConnectorConfig
    from kvwire.connectors.model_input import ModelInput

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
                or IntermediateTensors sliced the same way. Of a hidden-states tensor each
                request's last row travels (the next token is sampled from it alone); of
                IntermediateTensors every row.
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
            states; then the hidden states cover the whole batch (`[num_tokens, hidden]`: each
            request's last row the producer's, its other rows unwritten; IntermediateTensors
            whole). Otherwise hidden is None and the returned model_input is what must still
            be computed.
        """

    @property
    def receives_tails(self) -> bool:
        """Consumer: whether `recv_kv_caches_and_hidden_states` takes a prompt's tail, a `SequenceInput` from a
        block boundary (`start_pos`) with its whole prompt (`prompt_ids`), whose earlier blocks the caller holds
        (its prefix cache): only the tail's blocks are pulled. False (the default): whole prompts only."""
        return False

    def after_step(self, idle: bool = False) -> None:
        """The engine's step is done and its outputs sent (`idle`: and it has nothing to do): work the
        receives left for later happens now, all of it when idle."""

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
