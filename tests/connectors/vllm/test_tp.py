"""connectors/vllm/tp.py: every decode rank reads each of its KV heads exactly once, from a prefill rank that holds
it; every prefill copy is either read (and told how many read it) or declined by exactly one decode rank."""

from __future__ import annotations

import itertools

import pytest

from kvwire.connectors.vllm.tp import TPSplit, plan, rank_key

SHAPES = [(h, p, d) for h, p, d in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4])]


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), SHAPES)
def test_each_head_is_read_once_from_a_rank_that_holds_it(heads, p_tp, d_tp):
    prefill, decode = TPSplit(heads, p_tp), TPSplit(heads, d_tp)
    readers = {p: 0 for p in range(p_tp)}
    declined = {p: 0 for p in range(p_tp)}
    for d in range(d_tp):
        got: list[int] = []
        pulls = plan(prefill, decode, d)
        assert len({pull.rank for pull in pulls}) == len(pulls), "one pull per prefill rank"
        for pull in pulls:
            s = pull.heads
            if s.num_heads == 0:
                declined[pull.rank] += 1
                continue
            readers[pull.rank] += 1
            src = [prefill.first_head(pull.rank) + s.src_head + i for i in range(s.num_heads)]
            assert all(prefill.holds(pull.rank, h) for h in src)
            assert [decode.first_head(d) + s.dst_head + i for i in range(s.num_heads)] == src
            got += src
        assert sorted(got) == list(range(decode.first_head(d), decode.first_head(d) + decode.per_rank))
    for d in range(d_tp):
        for pull in plan(prefill, decode, d):
            if pull.heads.num_heads:
                assert pull.heads.pullers == readers[pull.rank]
    assert all((readers[p] > 0) != (declined[p] == 1) for p in range(p_tp))
    assert all(declined[p] <= 1 for p in range(p_tp))


def test_equal_tp_moves_whole_rows_and_replicas_spread():
    (only,) = plan(TPSplit(8, 2), TPSplit(8, 2), 1)
    assert only.rank == 1 and not only.heads.per_block and only.heads.pullers == 1
    mla = [plan(TPSplit(1, 2), TPSplit(1, 2), d) for d in range(2)]  # MLA: one latent on every rank
    assert [[p.rank for p in pulls] for pulls in mla] == [[0], [1]]
    (a, b) = plan(TPSplit(1, 4), TPSplit(1, 2), 0)
    assert (a.rank, a.heads.num_heads) == (0, 1) and (b.rank, b.heads.num_heads) == (2, 0)  # rank 2 declined


def test_gathering_from_two_prefill_ranks_lands_side_by_side():
    pulls = plan(TPSplit(4, 2), TPSplit(4, 1), 0)
    assert [(p.rank, p.heads.src_head, p.heads.dst_head, p.heads.num_heads) for p in pulls] == [(0, 0, 0, 2),
                                                                                                 (1, 0, 2, 2)]
    assert all(p.heads.per_block for p in pulls)


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="split evenly"):
        TPSplit(6, 4)
    with pytest.raises(ValueError, match="KV heads"):
        plan(TPSplit(4, 1), TPSplit(8, 1), 0)
    assert rank_key("r", 0, 1) == "r" and rank_key("r", 1, 2) == "r-tp1"
