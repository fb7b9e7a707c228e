"""One request as the engine tracks it: prompt, sampled tokens (and their logprobs), blocks, RNG, metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvwire.engine.outputs import RequestMetrics
from kvwire.engine.sampler import TokenHistory
from kvwire.protocol.work import SamplingParams, TokenLogprobs


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # end-of-sequence token (unless ignore_eos) or one of stop_token_ids
    ABORT = "abort"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    history: TokenHistory = field(default_factory=TokenHistory)  # what the penalties and min_tokens need
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output id when params.logprobs is set
    finish_reason: FinishReason | None = None
    receive_kv: bool = True  # ask the connector for the prompt's KV before computing it
    bypassed: bool = False
    prompt_shared: bool = False  # started from another request's prompt KV (engine/shared_prompts.py)
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache (not computed, not received)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
