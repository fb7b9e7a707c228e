"""Fixtures the transfer plane's tests share."""

from __future__ import annotations

import dataclasses

import pytest

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.standalone import open_consumer, open_producer
from kvwire.connectors.wire import KVLayout
from tests.connectors import peer


@pytest.fixture
def directory(redis_url: str):
    """A directory client on the session's Redis: entries live 5 s, node registrations 0.5 s."""
    d = KVDirectory(redis_url, entry_ttl_s=5.0, node_ttl_s=0.5)
    yield d
    d.close()


@pytest.fixture
def standalone_pair(redis_url: str):
    """`make(kind, name, layout, deadline_s, verify_kv)`: a standalone producer (`p-<name>`) and consumer
    (`c-<name>`) over `kind`, each on a CPU pool of 16 blocks of `layout`, `verify_kv` saying which of the two run
    with --verify-kv; returns `[producer, its pool, consumer, its pool]`. All are closed after the test."""
    made = []

    def make(kind: ConnectorKind, name: str, layout: KVLayout, deadline_s: float,
             verify_kv: tuple[bool, bool] = (False, False)) -> list:
        out = []
        for role, verify in ((NodeRole.PREFILL, verify_kv[0]), (NodeRole.DECODE, verify_kv[1])):
            node = f"{'p' if role == NodeRole.PREFILL else 'c'}-{name}"
            cfg = dataclasses.replace(peer.config(kind, role, node, redis_url, deadline_s), verify_kv=verify)
            pool = KVPool.allocate(layout, 16, "cpu")
            side = (open_producer if role == NodeRole.PREFILL else open_consumer)(cfg, kv_caches=pool.kv_caches)
            made.append(side)
            out += [side.connector, pool]
        return out

    yield make
    for side in made:
        side.close()
