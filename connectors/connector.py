"""The contract's two faces, one per role: what the engine's runner calls, built from a producer or a consumer.

Neither branches on a role: a prefill node's runner holds a `ProducerConnector`, a decode
node's a `ConsumerConnector`, and each refuses the other side's call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwire.connectors.base import HiddenStates, KVConnectorBase
from kvwire.connectors.config import ConnectorConfig
from kvwire.connectors.consumer.role import NOTE_AGE_S, KVConsumer
from kvwire.connectors.model_input import ModelInput
from kvwire.connectors.producer.role import KVProducer


def _check_views(kv_caches: list[torch.Tensor], node_id: str) -> None:
    if not kv_caches:
        raise ValueError(f"node {node_id}: no KV cache views to register")


class ProducerConnector(KVConnectorBase):
    """Prefill side: publishes each computed prompt's KV through `producer`."""

    def __init__(self, rank: int, local_rank: int, config: ConnectorConfig, producer: KVProducer):
        self.rank, self.local_rank, self.config = rank, local_rank, config
        self.producer = producer

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        _check_views(kv_caches, self.config.node_id)

    def send_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module | None, model_input: ModelInput,
                                         kv_caches: list[torch.Tensor],
                                         hidden_or_intermediate_states: HiddenStates) -> None:
        self.producer.publish(model_input, hidden_or_intermediate_states)

    def recv_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module | None, model_input: ModelInput,
                                         kv_caches: list[torch.Tensor]) -> tuple[HiddenStates | None, bool, ModelInput]:
        raise TypeError(f"node {self.config.node_id} produces KV; it does not receive any")

    def begin_layer_stream(self, model_input: ModelInput, hidden_size: int,
                           hidden_dtype: torch.dtype) -> Callable[[int], None] | None:
        if not self.config.layerwise:
            return None
        return self.producer.begin_layers(model_input, hidden_size, hidden_dtype)

    def abort_layer_stream(self, model_input: ModelInput, reason: str) -> None:
        self.producer.abort_layers(model_input, reason)

    def close(self) -> None:
        self.producer.close()


class ConsumerConnector(KVConnectorBase):
    """Decode side: receives each prompt's KV through `consumer`."""

    def __init__(self, rank: int, local_rank: int, config: ConnectorConfig, consumer: KVConsumer):
        self.rank, self.local_rank, self.config = rank, local_rank, config
        self.consumer = consumer

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        _check_views(kv_caches, self.config.node_id)

    def send_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module | None, model_input: ModelInput,
                                         kv_caches: list[torch.Tensor],
                                         hidden_or_intermediate_states: HiddenStates) -> None:
        raise TypeError(f"node {self.config.node_id} consumes KV; it does not send any")

    def recv_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module | None, model_input: ModelInput,
                                         kv_caches: list[torch.Tensor]) -> tuple[HiddenStates | None, bool, ModelInput]:
        return self.consumer.receive_batch(model_input)

    @property
    def receives_tails(self) -> bool:
        return self.consumer.pulls_tails

    def after_step(self, idle: bool = False) -> None:
        self.consumer.flush(0.0 if idle else NOTE_AGE_S)

    def close(self) -> None:
        self.consumer.close()
