"""A consumer that holds a prompt's first blocks (its prefix cache) pulls only the rest: the contract's receive of a
tail (`start_pos` on a block boundary, `prompt_ids` the whole prompt) writes the tail's blocks and no other, and
hands back the tail's hidden rows with the prompt's last row in place. With --verify-kv (checksums of the whole
prompt) the consumer takes whole prompts only."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.model_input import ModelInput, SequenceInput
from tests.connectors import peer

LAY = peer.layout(layers=3, block_size=4)
PROMPT = list(range(1, 15))  # 14 tokens: 4 blocks, the last partly full


@pytest.fixture
def pair(standalone_pair):
    return lambda kind, verify_kv=False: standalone_pair(kind, f"tail-{kind}", LAY, 5.0, (verify_kv, verify_kv))


@pytest.mark.parametrize("kind", [ConnectorKind.TCP, ConnectorKind.SHM, ConnectorKind.UCX])
def test_a_tail_pull_writes_the_tail_blocks_only(pair, kind):
    prod, ppool, cons, cpool = pair(kind)
    assert cons.receives_tails
    rid, src, dst = f"tail-{kind}", [2, 3, 4, 5], [9, 6, 7, 8]
    ppool.data[src] = peer.request_kv(rid, LAY, 4)
    hidden = peer.request_hidden(rid, len(PROMPT), False)
    prod.send_kv_caches_and_hidden_states(None, ModelInput([SequenceInput(rid, PROMPT, 0, src)]), ppool.kv_caches,
                                          hidden)
    cpool.data[9] = 5.0  # the cached first two blocks: 9 and 6
    cpool.data[6] = 5.0
    tail = SequenceInput(rid, PROMPT[8:], 8, dst, prompt_ids=PROMPT)
    got, bypass, _ = cons.recv_kv_caches_and_hidden_states(None, ModelInput([tail]), cpool.kv_caches)
    assert bypass
    assert torch.equal(cpool.data[[7, 8]], ppool.data[[4, 5]])  # the tail's blocks came
    assert bool((cpool.data[[9, 6]] == 5.0).all())  # the cached ones were not written
    assert isinstance(got, torch.Tensor) and got.shape == (6, peer.HIDDEN)  # the tail's rows
    assert torch.equal(got[-1], hidden[-1])  # the prompt's last row: the one the first token is sampled from


def test_a_tail_not_on_a_block_boundary_or_without_its_prompt_is_refused_and_recomputed(pair, caplog):
    prod, ppool, cons, cpool = pair(ConnectorKind.TCP)
    for n, (rid, tail) in enumerate((("off-boundary", SequenceInput("off-boundary", PROMPT[6:], 6, [9, 6, 7, 8],
                                                                    prompt_ids=PROMPT)),
                                     ("no-prompt", SequenceInput("no-prompt", PROMPT[8:], 8, [9, 6, 7, 8])))):
        src = [2 + 4 * n, 3 + 4 * n, 4 + 4 * n, 5 + 4 * n]
        prod.send_kv_caches_and_hidden_states(None, ModelInput([SequenceInput(rid, PROMPT, 0, src)]),
                                              ppool.kv_caches, torch.zeros(len(PROMPT), peer.HIDDEN))
        got, bypass, back = cons.recv_kv_caches_and_hidden_states(None, ModelInput([tail]), cpool.kv_caches)
        assert (got, bypass, back.sequences) == (None, False, [tail])
        assert f"request {rid}" in caplog.text and "pulled only from a block boundary" in caplog.text


def test_with_checksums_a_consumer_takes_whole_prompts_only(pair):
    _, _, cons, _ = pair(ConnectorKind.TCP, verify_kv=True)
    assert not cons.receives_tails
