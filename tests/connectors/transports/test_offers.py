"""Choosing a transport among a producer's offers (auto and mixed clusters)."""

import pytest

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.transports.auto.puller import preference
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.offers import narrow
from kvwire.connectors.wire import DType, KVLayout, KVLocation, TransportOffer

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=DType.FLOAT32)


def _loc(offers, host="", kind=ConnectorKind.AUTO) -> KVLocation:
    first = offers[0] if offers else TransportOffer(kind, "tcp://p:1", b"only")
    return KVLocation(request_id="r", producer="p", producer_epoch=1, kind=kind, side_channel=first.side_channel,
                      transport_address=first.transport_address, layout=LAYOUT, block_ids=[0], num_tokens=1,
                      hidden=[], offers=offers, host=host)


OFFERS = [TransportOffer(ConnectorKind.SHM, "tcp://p:1", b"shm-addr"),
          TransportOffer(ConnectorKind.UCX, "tcp://p:2", b"ucx-addr")]


def test_narrow_picks_the_first_wanted_offer_and_rewrites_the_location():
    loc = narrow(_loc(OFFERS), [ConnectorKind.UCX, ConnectorKind.SHM])
    assert (loc.kind, loc.side_channel, loc.transport_address) == (ConnectorKind.UCX, "tcp://p:2", b"ucx-addr")
    assert loc.block_ids == [0] and loc.request_id == "r"


def test_single_transport_location_passes_unchanged_or_is_refused():
    single = _loc([], kind=ConnectorKind.TCP)
    assert narrow(single, [ConnectorKind.TCP]) is single
    with pytest.raises(TransferError, match="producer offers tcp; this node speaks ucx"):
        narrow(single, [ConnectorKind.UCX])


def test_auto_uses_shared_memory_only_on_the_same_host():
    assert preference(_loc(OFFERS, host=host_identity()))[0] == ConnectorKind.SHM
    assert preference(_loc(OFFERS, host="elsewhere/boot")) == [ConnectorKind.UCX]
    assert preference(_loc(OFFERS, host="")) == [ConnectorKind.UCX]
    assert narrow(_loc(OFFERS, host="elsewhere/boot"), preference(_loc(OFFERS, host="elsewhere/boot"))).kind == "ucx"
