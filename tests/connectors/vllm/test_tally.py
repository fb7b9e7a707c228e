"""The vLLM connector's counts of pulls and recomputed prompts (no vLLM needed: what vLLM makes of them,
and the worker's warnings, are tests/vllm/test_stats.py)."""

from __future__ import annotations

from kvwire.connectors.vllm.tally import Tally
from kvwire.observability.labels import TransferFailure, TransportFallback


def test_a_tally_hands_over_its_counts_once_and_starts_again():
    tally = Tally()
    assert tally.take() is None, "nothing counted: nothing to report"
    tally.pulled(1000, 0.002)
    tally.pulled(24, 0.001, TransportFallback.CMA_REFUSED, "sysv/posix")
    tally.failed(TransferFailure.DEADLINE)
    tally.failed(TransferFailure.DEADLINE)
    assert tally.take() == {"pulls": 2, "pull_bytes": 1024, "pull_seconds": [0.002, 0.001],
                            "failed": {"deadline": 2}, "fallbacks": {"cma_refused": 1},
                            "paths": {"sysv/posix": 1}, "rejected": 0}
    assert tally.take() is None


def test_rejections_are_counted_once_each_from_the_process_total():
    tally = Tally()
    tally.rejected_so_far(0)
    assert tally.take() is None
    tally.rejected_so_far(3)
    tally.rejected_so_far(3)  # asked again each step: nothing new
    assert tally.take()["rejected"] == 3
    tally.rejected_so_far(4)
    assert tally.take()["rejected"] == 1 and tally.take() is None
