"""Choosing how to pull: a producer may offer its KV over several transports (auto)."""

from __future__ import annotations

import msgspec

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.wire import KVLocation, TransportOffer


def narrow(loc: KVLocation, kinds: list[ConnectorKind]) -> KVLocation:
    """The location as seen through the first of `kinds` the producer offers.

    A location with no offers (one transport) is returned as it is when its kind is wanted.

    Raises:
        TransferError: the producer offers none of `kinds`.
    """
    offers: dict[ConnectorKind, TransportOffer | None] = {o.kind: o for o in loc.offers} or {loc.kind: None}
    for kind in kinds:
        if kind in offers:
            o = offers[kind]
            if o is None:
                return loc
            return msgspec.structs.replace(loc, kind=o.kind, side_channel=o.side_channel,
                                           transport_address=o.transport_address)
    raise TransferError(loc.request_id, loc.producer,
                        f"producer offers {', '.join(map(str, offers))}; this node speaks {', '.join(map(str, kinds))}")
