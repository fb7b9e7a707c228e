"""The stand-in vLLM servers the vLLM-mode router's tests run against (tests/router/fake_vllm.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwire.cluster.ports import free_port
from tests.router.fake_vllm import FakeVLLM


@pytest.fixture
def fakes() -> Iterator[dict[str, FakeVLLM]]:
    """A prefill ("p") and two decode ("d1", "d2") stand-ins, serving."""
    made = {name: FakeVLLM(name, free_port()) for name in ("p", "d1", "d2")}
    for fake in made.values():
        fake.start()
    yield made
    for fake in made.values():
        fake.stop()
