"""Hidden states to and from bytes: every dtype that travels, from a peer's read-only memory, without warnings."""

from __future__ import annotations

import mmap
import warnings

import pytest
import torch

from kvwire.connectors.hidden import fill_tensors, host_bytes


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
