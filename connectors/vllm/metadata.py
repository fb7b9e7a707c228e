"""What the scheduler half tells the worker half each step (vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvwire.connectors.vllm.params import RemotePrefill


@dataclass(frozen=True)
class Hold:
    """Producer: a finished prompt whose blocks wait for a consumer."""

    block_ids: list[int]  # those a consumer may pull, group after group (groups.py)
    num_tokens: int
    error: str = ""  # why there is nothing to hold after all: the worker fails the entry with it
    key: str = ""  # the directory key (params.key_of); "": the request id
    prompt: str = ""  # the fingerprint of its first num_tokens prompt tokens (connectors/prompt.py)


@dataclass(frozen=True)
class Pull:
    """Consumer: a prompt whose KV lands in `block_ids` at the positions `pick` (the others are prefix-cached
    or out of a sliding window)."""

    remote: RemotePrefill
    num_tokens: int  # the prompt tokens loaded (must equal the producer's): all, or all but the backoff
    block_ids: list[int]  # the request's blocks, paired with the producer's held list (groups.py)
    pick: list[int]
    error: str = ""  # why it cannot be pulled after all: the worker fails the request with it (vLLM recomputes)
    prompt: str = ""  # the fingerprint of its first num_tokens prompt tokens: the producer's must be the same


@dataclass
class KvwireMetadata(KVConnectorMetadata):
    hold: dict[str, Hold] = field(default_factory=dict)  # vLLM request id -> blocks to hold
    pull: dict[str, Pull] = field(default_factory=dict)  # vLLM request id -> KV to pull
    abandon: list[RemotePrefill] = field(default_factory=list)  # prompts this instance will never pull
    idle: bool = False  # the step computes no token: the worker may wait a little for a transfer to end
