"""What an engine step reports: the tokens it sampled per request, and each request's timings (shaped like
vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and durations of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float = 0.0
    model_forward_time: float = 0.0
    model_execute_time: float = 0.0

    def mark_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
            self.time_in_queue = now - self.arrival_time

    def mark_first_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class ModelRunnerOutput:
    """What one engine step produced: one sampled token per scheduled request."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_tokens(cls, req_ids: list[str], tokens: list[int]) -> ModelRunnerOutput:
        return cls(
            req_ids=list(req_ids),
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[t] for t in tokens],
        )
