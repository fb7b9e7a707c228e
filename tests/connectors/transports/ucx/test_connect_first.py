"""A consumer's lanes make their endpoints to the producer before asking it to send (puller.py): lanes that
cannot reach the producer fail the pull without the producer ever being asked to send to them, since the
puller replaces those lanes at once and the producer would be connecting to workers that are gone."""

from __future__ import annotations

import pytest
import zmq

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.ucx.puller import UCXPuller
from kvwire.connectors.transports.ucx.worker import LANES_MAGIC, Role, UCXWorker
from kvwire.connectors.wire import KVLocation
from tests.connectors import peer


def _location(side_channel: str, transport_address: bytes) -> KVLocation:
    return KVLocation(request_id="r1", producer="prefill-0", producer_epoch=1, kind=ConnectorKind.UCX,
                      side_channel=side_channel, transport_address=transport_address, layout=peer.layout(),
                      block_ids=[0, 1], num_tokens=4, hidden=[])


@pytest.fixture
def side_channel():
    """A producer's side channel that only counts what reaches it."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)


def test_lanes_that_cannot_reach_the_producer_fail_before_it_is_asked(side_channel):
    sock, url = side_channel
    pool = KVPool.allocate(peer.layout(), 8, "cpu")
    puller = UCXPuller("decode-0", KVRegion.from_kv_caches(pool.kv_caches), lanes=2)
    before = puller.transport_address
    try:
        with pytest.raises(TransferError, match="truncated lane address"):
            puller.pull(_location(url, LANES_MAGIC + b"\x00\x00"), [2, 3], [], deadline=float("inf"))
        assert sock.poll(200) == 0, "the producer was asked to send to lanes that could not reach it"
        assert puller.transport_address != before  # those lanes were replaced (fenced)
    finally:
        puller.close()


def test_a_reachable_producer_is_asked_once_its_endpoints_exist(side_channel):
    sock, url = side_channel
    producer = UCXWorker(Role.PRODUCER)
    pool = KVPool.allocate(peer.layout(), 8, "cpu")
    puller = UCXPuller("decode-0", KVRegion.from_kv_caches(pool.kv_caches))
    try:
        with pytest.raises(TransferError):  # nobody sends: the deadline passes
            puller.pull(_location(url, producer.address), [2, 3], [], deadline=0.0)
        assert sock.poll(1000) == zmq.POLLIN, "the producer was never asked"
    finally:
        puller.close()
        producer.close()
