"""Runs the model on one batch, calling the KV connector at the contract's two points.

The runner holds no role: it is given the connector as the side it calls. A prompt batch:

1. With a `consumer` connector: the runner asks it for the batch's KV and hidden states
   (within the engine's step, or on its pull thread with `start_receive`, one pull at a
   time, while the engine keeps decoding; then `finish_prompt` once the pull has ended).
2. When every request got its KV the forward is skipped (bypass); otherwise the prompt is
   computed here.
3. With a `producer` connector: the runner computes the prompt (handing each layer to it as
   it is written, when it streams) and then hands KV and hidden states over.

Decode batches never touch the connector. `close()` stops the pull thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvwire.connectors.base import KVConnectorBase
from kvwire.connectors.kv_pool import TORCH_DTYPES, KVPool
from kvwire.connectors.model_input import ModelInput
from kvwire.connectors.types import IntermediateTensors
from kvwire.engine.model import LlamaForCausalLM
from kvwire.observability.metrics import process_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptResult:
    last_hidden: torch.Tensor  # [num_sequences, hidden]: each sequence's last prompt token
    bypassed: bool
    forward_s: float


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, *, producer: KVConnectorBase | None = None,
                 consumer: KVConnectorBase | None = None):
        """Args:
        producer: the connector that takes each computed prompt's KV and hidden states (a prefill node's).
        consumer: the connector asked for each prompt's KV before its forward (a decode node's).
        """
        assert producer is None or consumer is None, "a runner hands KV over or receives it, not both"
        self.model = model
        self.pool = pool
        self.kv_caches = pool.kv_caches
        self._producer, self._consumer = producer, consumer
        for connector in (producer, consumer):
            if connector is not None:
                connector.register_kv_caches(self.kv_caches)
        self._pulls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-pull") if consumer else None

    @property
    def receives_async(self) -> bool:
        """Whether prompts' KV can be received on the pull thread (`start_receive`)."""
        return self._pulls is not None

    @property
    def pulls_whole_prompts(self) -> bool:
        """Whether a prompt's KV is received whole, never from a later block (KVConnectorBase.receives_tails):
        then a prompt that asks for its KV must not start on cached blocks."""
        return self._consumer is not None and not self._consumer.receives_tails

    def start_receive(self, model_input: ModelInput) -> Future:
        """Ask the consumer connector for the prompt batch's KV and hidden states on the pull thread
        (pulls run one at a time, in order). The future holds the contract's
        `(hidden, bypass, model_input)`; pass it to `finish_prompt` once done."""
        assert self._pulls is not None and self._consumer is not None and model_input.is_prompt
        return self._pulls.submit(self._consumer.recv_kv_caches_and_hidden_states, self.model, model_input,
                                  self.kv_caches)

    @torch.inference_mode()
    def finish_prompt(self, model_input: ModelInput, received: Future) -> PromptResult:
        """A prompt batch whose receive has ended: bypassed with its hidden states, or computed now."""
        start = time.monotonic()
        try:
            hidden, bypassed, model_input = received.result()
        except Exception:  # noqa: BLE001 - a connector bug must cost a recompute, not the request
            log.exception("receiving the KV of %s failed; recomputing", model_input.request_ids)
            hidden, bypassed = None, False
        if not bypassed:
            hidden = self._forward_prompt(model_input)
        return self._prompt_result(model_input, hidden, bypassed, time.monotonic() - start)

    def after_step(self, idle: bool = False) -> None:
        """The step's outputs are out (`idle`: and nothing is left to do): the connector's deferred work (a
        consumer's read notes) runs now."""
        if self._consumer is not None:
            self._consumer.after_step(idle)

    def close(self) -> None:
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)

    @torch.inference_mode()
    def run_prompt(self, model_input: ModelInput, receive_kv: bool = True) -> PromptResult:
        assert model_input.is_prompt
        hidden, bypassed = None, False
        start = time.monotonic()
        if self._consumer is not None and receive_kv:
            hidden, bypassed, model_input = self._consumer.recv_kv_caches_and_hidden_states(
                self.model, model_input, self.kv_caches)
        if not bypassed:
            hidden = self._forward_prompt(model_input)
        forward_s = time.monotonic() - start
        assert hidden is not None
        if self._producer is not None:
            self._producer.send_kv_caches_and_hidden_states(self.model, model_input, self.kv_caches, hidden)
        return self._prompt_result(model_input, hidden, bypassed, forward_s)

    @staticmethod
    def _prompt_result(model_input: ModelInput, hidden, bypassed: bool, forward_s: float) -> PromptResult:
        if isinstance(hidden, IntermediateTensors):
            raise TypeError("a last pipeline stage returns a hidden-states tensor")
        last_rows = [s.stop - 1 for s in model_input.token_slices()]
        return PromptResult(hidden[last_rows], bypassed, forward_s)

    def _forward_prompt(self, model_input: ModelInput) -> torch.Tensor:
        """The prompt's forward; a producer streaming layer-wise hands over each layer as it is written."""
        on_layer, producer = None, self._producer
        if producer is not None:
            cfg = self.model.config
            on_layer = producer.begin_layer_stream(model_input, cfg.hidden_size, TORCH_DTYPES[cfg.dtype])
        start = time.monotonic()
        try:
            hidden = self.model(model_input, self.kv_caches, on_layer=on_layer)
        except Exception as exc:
            if on_layer is not None and producer is not None:
                producer.abort_layer_stream(model_input, f"prefill forward failed: {exc}")
            raise
        process_metrics().prompt_forward_seconds.observe(time.monotonic() - start)
        return hidden

    @torch.inference_mode()
    def run_decode(self, model_input: ModelInput) -> torch.Tensor:
        """Returns `[num_sequences, hidden]` for a batch of one new token per sequence."""
        assert not model_input.is_prompt
        return self.model(model_input, self.kv_caches)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's KV, every layer's, within the pool."""
        self.pool.data[dst].copy_(self.pool.data[src])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)  # [B, vocab] float32
