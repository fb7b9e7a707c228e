"""A producer's first directory act: fail the READY entries its earlier incarnations left behind.

A producer that dies (SIGKILL, OOM, a lost host) takes the KV it held with it, but the READY
entries naming it stay until their TTL: a consumer that has not pulled yet would wait for a
pull that cannot succeed, and a request pulled whole just before the kill (the producer marks
it CONSUMED after the last byte) is left READY though nobody will ever touch it again. A new
incarnation of the same node id has a higher epoch, so it knows the earlier one is dead or
fenced off: when it starts it fails every READY entry that names its node id with an older
epoch. Waiting consumers then recompute at once, and the directory keeps nothing nobody cleans.
"""

from __future__ import annotations

import logging

from kvwire.connectors.directory.batch import DirectoryBatch
from kvwire.connectors.directory.directory import KVDirectory, TransferState

log = logging.getLogger(__name__)


def fail_earlier_incarnations(directory: KVDirectory, node_id: str, epoch: int) -> list[str]:
    """Move every READY entry published by `node_id` with an epoch below `epoch` to FAILED.

    Returns:
        The ids of the requests failed here (an entry another party moved on meanwhile is left alone).
    Raises:
        DirectoryError: the directory cannot be read or written.
    """
    stale = [a.entry.request_id for a in directory.entries_with_age()
             if a.entry.state == TransferState.READY and a.entry.producer == node_id
             and a.entry.location is not None and a.entry.location.producer_epoch < epoch]
    if not stale:
        return []
    batch = DirectoryBatch(directory)
    reason = f"producer {node_id} restarted (now epoch {epoch}); the KV its earlier incarnation held is gone"
    for rid in stale:
        batch.transition(rid, {TransferState.READY}, TransferState.FAILED, reason)
    failed = [rid for rid, changed in zip(stale, batch.execute()) if changed]
    if failed:
        log.warning("node %s (epoch %d): failed %d READY entries its earlier incarnations left: %s", node_id,
                    epoch, len(failed), ", ".join(failed[:8]) + (" ..." if len(failed) > 8 else ""))
    return failed
