"""--verify-kv: per-layer checksums travel with the location; a consumer holding other bytes recomputes."""

from __future__ import annotations

import pytest
import torch

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.transports.kv_checksum import layer_checksums
from kvwire.connectors.transports.kv_region import KVRegion
from tests.connectors import peer

LAY = peer.layout(layers=4, block_size=4)


@pytest.fixture
def pair(standalone_pair):
    return lambda producer_verifies, consumer_verifies: standalone_pair(ConnectorKind.TCP, "verify", LAY, 3.0,
                                                                       (producer_verifies, consumer_verifies))


def _move(prod, ppool, cons, cpool, rid: str, corrupt=None):
    ppool.data[[2, 3]] = peer.request_kv(rid, LAY, 2)
    prod.send_kv_caches_and_hidden_states(None, ModelInput([SequenceInput(rid, [1] * 8, 0, [2, 3])]),
                                          ppool.kv_caches, torch.zeros(8, 4))
    if corrupt:
        corrupt(ppool)
    _, bypass, _ = cons.recv_kv_caches_and_hidden_states(None, ModelInput([SequenceInput(rid, [1] * 8, 0, [9, 5])]),
                                                         cpool.kv_caches)
    return bypass


def test_checksums_cover_each_layer_in_block_order():
    region = KVRegion.from_kv_caches(KVPool.allocate(LAY, 8).kv_caches)
    region.planes[0][1].fill_(7)
    base = layer_checksums(region, [1, 2])
    assert len(base) == 4 and layer_checksums(region, [2, 1]) != base  # order matters
    region.planes[0][2].view(4, -1)[3].fill_(1)  # layer 3 of block 2 only
    changed = layer_checksums(region, [1, 2])
    assert changed[:3] == base[:3] and changed[3] != base[3]


def test_verified_transfer_bypasses(pair):
    prod, ppool, cons, cpool = pair(True, True)
    assert _move(prod, ppool, cons, cpool, "v-ok")
    assert torch.equal(cpool.data[[9, 5]], peer.request_kv("v-ok", LAY, 2))


def test_bytes_changed_after_publishing_are_caught_and_recomputed(pair):
    prod, ppool, cons, cpool = pair(True, True)

    def reuse_block(pool):  # the producer's block reassigned before the pull: what a stale read would see
        pool.data[3, 1].fill_(0.5)

    assert not _move(prod, ppool, cons, cpool, "v-bad", corrupt=reuse_block)


def test_consumer_requires_checksums_from_the_producer(pair):
    prod, ppool, cons, cpool = pair(False, True)
    assert not _move(prod, ppool, cons, cpool, "v-missing")
