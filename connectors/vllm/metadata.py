"""What the scheduler half tells the worker half each step (vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvwire.connectors.vllm.params import RemotePrefill


@dataclass(frozen=True)
class Hold:
    """Producer: a finished prompt whose blocks wait for a consumer."""

    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class Pull:
    """Consumer: a prompt whose KV lands in `block_ids[first_block:]` (the ones before are prefix-cached)."""

    remote: RemotePrefill
    num_tokens: int  # the prompt's length here (must equal the producer's)
    block_ids: list[int]  # the request's blocks covering the prompt
    first_block: int


@dataclass
class KvwireMetadata(KVConnectorMetadata):
    hold: dict[str, Hold] = field(default_factory=dict)  # vLLM request id -> blocks to hold
    pull: dict[str, Pull] = field(default_factory=dict)  # vLLM request id -> KV to pull
    abandon: list[RemotePrefill] = field(default_factory=list)  # prompts this instance will never pull
