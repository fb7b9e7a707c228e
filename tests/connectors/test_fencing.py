"""Fencing: a producer incarnation older than the latest one cannot publish KV (real redis-server)."""

from __future__ import annotations

import msgspec
import pytest

from bench.directory import _location
from connectors.directory import KVDirectory, StaleNodeError, TransferState
from connectors.directory_batch import DirectoryBatch


def test_an_old_epoch_is_fenced_off(redis_url):
    d = KVDirectory(redis_url, namespace="fence-test")
    try:
        old = d.next_epoch("bench-prefill")
        new = d.next_epoch("bench-prefill")  # the node restarted
        assert new > old
        stale = msgspec.structs.replace(_location("r-old"), producer_epoch=old)
        with pytest.raises(StaleNodeError, match="stale") as info:
            d.publish_ready(stale)
        assert info.value.request_id == "r-old"
        assert d.get("r-old") is None  # nothing written
        assert d.publish_ready(msgspec.structs.replace(_location("r-new"), producer_epoch=new))
        assert d.get("r-new").state == TransferState.READY
        fenced, fresh = DirectoryBatch(d).publish_ready(msgspec.structs.replace(_location("b-old"), producer_epoch=old)) \
            .publish_ready(msgspec.structs.replace(_location("b-new"), producer_epoch=new)).execute()
        assert (fenced, fresh) == (False, True) and d.get("b-old") is None
    finally:
        d.close()
