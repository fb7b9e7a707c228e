"""Fixtures the transfer plane's tests share."""

from __future__ import annotations

import pytest

from kvwire.connectors.directory.directory import KVDirectory


@pytest.fixture
def directory(redis_url: str):
    """A directory client on the session's Redis: entries live 5 s, node registrations 0.5 s."""
    d = KVDirectory(redis_url, entry_ttl_s=5.0, node_ttl_s=0.5)
    yield d
    d.close()
