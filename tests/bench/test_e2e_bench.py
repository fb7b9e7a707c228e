"""`kvwire bench e2e` at a small size: a real cluster, both modes, outputs equal across them."""

from __future__ import annotations

import pytest

from kvwire.bench.e2e import bench_e2e
from kvwire.bench.prompts import PROMPTS
from kvwire.connectors.config import ConnectorKind

pytestmark = pytest.mark.slow


def test_both_modes_serve_the_mix_and_agree(tiny_model_dir):
    result = bench_e2e(tiny_model_dir, ConnectorKind.TCP, rounds=1, max_tokens=4)
    disagg, single = result.modes
    assert (disagg.mode, single.mode) == ("disaggregated", "single-node")
    assert disagg.requests == single.requests == 2 * len(PROMPTS)  # one sequential pass + one burst
    assert disagg.bypassed == disagg.requests and single.bypassed == 0  # KV moved / prompt recomputed
    assert disagg.transfer_ms_p50 > 0 and single.transfer_ms_p50 == 0
    assert result.outputs_equal
    assert result.forward_ms_prefill_node > 0 and result.forward_ms_decode_node > 0  # each computed its mode's prompts
    assert result.transfer_ms_mean > 0
    forward_diff = result.forward_ms_prefill_node - result.forward_ms_decode_node
    assert result.gap_beside_forward_ms == pytest.approx(result.ttft_gap_ms_mean - forward_diff, abs=0.011)
    for m in result.modes:
        assert 0 < m.ttft_ms_p50 <= m.ttft_ms_p99 and m.throughput_tok_s > 0 and m.tpot_ms_p50 > 0
    assert result.bare_gap_ms_p50 is not None  # the bare chain ran beside it
    assert result.kvwire_gap_ms == pytest.approx(result.ttft_gap_ms_p50 - result.bare_gap_ms_p50, abs=0.011)
