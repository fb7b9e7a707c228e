"""A consumer keeps its transport addresses published: they expire with entry_ttl_s, and a producer refuses
pulls to an address nobody published. Every pull path (the contract's batch receive and `receive_blocks`,
which vLLM's connector uses) republishes them once a third of the TTL has passed."""

from __future__ import annotations

import time

import pytest

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.standalone import open_consumer
from tests.connectors import peer


def test_receive_blocks_republishes_expired_addresses(redis_url):
    config = ConnectorConfig(ConnectorKind.TCP, NodeRole.DECODE, "d-addr", redis_url, kv_deadline_s=0.5,
                             entry_ttl_s=1.0)
    side = open_consumer(config, layout=peer.layout(), num_blocks=8)
    directory = KVDirectory(redis_url)
    try:
        assert directory.transport_address_of("d-addr", ConnectorKind.TCP) is not None
        time.sleep(1.3)  # past the TTL: gone
        assert directory.transport_address_of("d-addr", ConnectorKind.TCP) is None
        with pytest.raises(TransferError):  # nobody produces r-1: it fails, but the addresses are back
            side.consumer.receive_blocks("r-1", 8, [0, 1])
        assert directory.transport_address_of("d-addr", ConnectorKind.TCP) is not None
    finally:
        directory.close()
        side.close()
