"""The peak-memory probe sees a transient allocation after it is freed, and not memory held before."""

from __future__ import annotations

import torch

from kvwire.bench.memory import PeakTracker


def test_peak_counts_transient_memory_only():
    held = torch.ones(32 << 20, dtype=torch.uint8)  # 32 MiB touched before measuring
    peak = PeakTracker().start()
    transient = torch.ones(96 << 20, dtype=torch.uint8)  # touched, then freed
    del transient
    extra = peak.extra_bytes()
    assert 90 << 20 <= extra <= 140 << 20
    assert held.sum().item() == 32 << 20
