"""Runs the model on one batch, calling the KV connector at the contract's two points.

Prompt batches: a decode-role runner first asks the connector for the batch's KV and
hidden states and skips the forward when it got them all (bypass); otherwise it
computes the prompt. A prefill-role runner computes the prompt and then hands KV and
hidden states to the connector. Decode batches never touch the connector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from connectors.base import KVConnectorBase
from connectors.config import NodeRole
from connectors.types import IntermediateTensors
from engine.kv_cache import TORCH_DTYPES, KVPool
from engine.model import LlamaForCausalLM
from engine.model_input import ModelInput


@dataclass(frozen=True)
class PromptResult:
    last_hidden: torch.Tensor  # [num_sequences, hidden]: each sequence's last prompt token
    bypassed: bool
    forward_s: float


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool,
                 connector: KVConnectorBase | None = None, role: NodeRole | None = None):
        self.model = model
        self.pool = pool
        self.kv_caches = pool.kv_caches
        self.connector = connector
        self.role = role
        if connector is not None:
            connector.register_kv_caches(self.kv_caches)

    @torch.inference_mode()
    def run_prompt(self, model_input: ModelInput, receive_kv: bool = True) -> PromptResult:
        assert model_input.is_prompt
        hidden, bypassed = None, False
        start = time.monotonic()
        if self.connector is not None and self.role == NodeRole.DECODE and receive_kv:
            hidden, bypassed, model_input = self.connector.recv_kv_caches_and_hidden_states(
                self.model, model_input, self.kv_caches)
        if not bypassed:
            hidden = self._forward_prompt(model_input)
        forward_s = time.monotonic() - start
        if self.connector is not None and self.role == NodeRole.PREFILL:
            self.connector.send_kv_caches_and_hidden_states(self.model, model_input, self.kv_caches, hidden)
        if isinstance(hidden, IntermediateTensors):
            raise TypeError("a last pipeline stage returns a hidden-states tensor")
        last_rows = [s.stop - 1 for s in model_input.token_slices()]
        return PromptResult(hidden[last_rows], bypassed, forward_s)

    def _forward_prompt(self, model_input: ModelInput) -> torch.Tensor:
        """The prompt's forward; a producer streaming layer-wise hands over each layer as it is written."""
        on_layer = None
        if self.connector is not None and self.role == NodeRole.PREFILL:
            cfg = self.model.config
            on_layer = self.connector.begin_layer_stream(model_input, cfg.hidden_size, TORCH_DTYPES[cfg.dtype])
        try:
            return self.model(model_input, self.kv_caches, on_layer=on_layer)
        except Exception as exc:
            if on_layer is not None:
                self.connector.abort_layer_stream(model_input, f"prefill forward failed: {exc}")
            raise

    @torch.inference_mode()
    def run_decode(self, model_input: ModelInput) -> torch.Tensor:
        """Returns `[num_sequences, hidden]` for a batch of one new token per sequence."""
        assert not model_input.is_prompt
        return self.model(model_input, self.kv_caches)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)  # [B, vocab] float32
