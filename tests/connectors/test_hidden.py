"""Hidden states: what travels of a request's (a last stage's: its prompt's last row; a pipeline stage's: every row),
the batch rejoined from them, and their bytes: every dtype that travels, from a peer's read-only memory, without
warnings."""

from __future__ import annotations

import mmap
import warnings

import pytest
import torch

from kvwire.connectors.hidden import HIDDEN_KEY, fill_tensors, host_bytes, join_requests, split_request
from kvwire.connectors.types import IntermediateTensors


def _read_only(data: memoryview) -> memoryview:
    """`data` in an anonymous mapping made read-only, as a producer's memory is to its consumer."""
    m = mmap.mmap(-1, max(len(data), 1))
    m[:len(data)] = data
    m.seek(0)
    return memoryview(m)[:len(data)].toreadonly()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_fill_tensors_copies_back_to_back_bytes_exactly_from_read_only_memory(dtype):
    sources = [torch.randn(5, 7).to(dtype), torch.randn(3).to(dtype), torch.empty(0, dtype=dtype)]
    data = _read_only(host_bytes(sources))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a read-only buffer handed to torch would warn
        with torch.inference_mode():  # as the runner's receive: its tensors are inference tensors
            out = [torch.empty_like(s) for s in sources]
            assert fill_tensors(out, data) == sum(s.numel() * s.element_size() for s in sources)
    assert all(torch.equal(o, s) for o, s in zip(out, sources))


def test_fill_tensors_refuses_a_size_that_does_not_match():
    with pytest.raises(ValueError, match="expected 8"):
        fill_tensors([torch.empty(2)], memoryview(b"x" * 9))


def test_a_last_stage_sends_each_prompts_last_row_and_the_batch_is_rejoined_around_them():
    """The first token is sampled from a prompt's last row and nothing reads the others: one row travels (of a
    Llama-3-8B 2,048-token prompt, 8 KiB instead of 16 MiB), and the batch the consumer returns has every request's
    last row where the runner reads it."""
    batch = torch.randn(9, 4)  # [tokens, hidden]: a prompt of 5 tokens, then one of 4
    slices = [slice(0, 5), slice(5, 9)]
    sent = [split_request(batch, rows) for rows in slices]
    assert [(d[0].name, d[0].shape, inter) for d, _, inter in sent] == [(HIDDEN_KEY, (1, 4), False)] * 2
    assert all(torch.equal(t[0], batch[rows][-1:]) for (_, t, _), rows in zip(sent, slices))
    joined = join_requests([t for _, t, _ in sent], sent[0][0], False, [5, 4])
    assert isinstance(joined, torch.Tensor) and joined.shape == (9, 4)
    assert torch.equal(joined[[4, 8]], batch[[4, 8]])
    one = join_requests([sent[1][1]], sent[1][0], False, [4])
    assert one.shape == (4, 4) and torch.equal(one[3], batch[8])


def test_every_row_of_an_older_producer_or_of_a_pipeline_stage_is_joined_as_it_came():
    batch = torch.randn(7, 4)
    older = [[batch[:3]], [batch[3:]]]  # a producer of an earlier build sent every row
    desc = split_request(batch, slice(0, 3))[0]
    assert torch.equal(join_requests(older, desc, False, [3, 4]), batch)
    stage = IntermediateTensors({"hidden_states": batch, "residual": batch * 2})
    descs, tensors, intermediate = split_request(stage, slice(3, 7))
    assert intermediate and [d.shape for d in descs] == [(4, 4), (4, 4)]
    first = split_request(stage, slice(0, 3))[1]
    assert join_requests([first, tensors], descs, True, [3, 4]) == stage
