"""What a send engine is given, for unit tests that drive one alone: a held request with no hidden states and no
layer gate, and `Claims` that record what the engine reported (the transfer server's part)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvwire.connectors.transports.transport import SendJob


@dataclass
class Held:
    hidden: list[torch.Tensor] = field(default_factory=list)
    gate: object = None


class RecordingClaims:
    def __init__(self) -> None:
        self.finished: list[tuple[SendJob, BaseException | None]] = []
        self.settled_jobs: list[SendJob] = []
        self.events: list[tuple[str, SendJob]] = []  # ("finish" | "settled", job), in the order they came

    def claim(self, msg, identity=b""):
        raise AssertionError("this engine takes no pulls itself")

    def finish(self, job: SendJob, error: BaseException | None, settling: bool = False) -> None:
        self.finished.append((job, error))
        self.events.append(("finish", job))

    def settled(self, job: SendJob) -> None:
        self.settled_jobs.append(job)
        self.events.append(("settled", job))
