"""The bare chain (`kvwire bench e2e`'s baseline): two real engine processes over zmq, no kvwire."""

from __future__ import annotations

import pytest

from kvwire.bench.bare_chain import BareChain

pytestmark = pytest.mark.slow


def test_both_modes_answer_with_the_same_first_token(tiny_model_dir):
    """Disaggregated, the decode process samples from the prefill process's hidden row: the same greedy first
    token as computing the prompt itself."""
    with BareChain(tiny_model_dir, num_blocks=16) as chain:
        procs = list(chain._procs)  # test-only reach: are they stopped afterwards
        for prompt in ([5, 6, 7], list(range(1, 40))):
            d_ms, d_token = chain.ask(prompt, 4, disaggregated=True)
            s_ms, s_token = chain.ask(prompt, 4, disaggregated=False)
            assert d_ms > 0 and s_ms > 0
            assert d_token == s_token
    assert not any(p.is_alive() for p in procs)
