"""Keeps a node registered in the directory while it runs.

Lifecycle of a node's registration:

1. `start()` registers the node at once, raising if that fails.
2. A daemon thread refreshes the registration every node_ttl_s/3, waiting on an Event
   between beats, and then runs `on_beat` (a consumer republishes its transport addresses:
   a Redis that lost its data has them back within one beat, like the registration), and
   `on_restored` after a beat that found the directory had lost the node (a producer
   advertises the KV it still holds again).
3. `mark_draining()` (optional) rewrites the registration at once with `draining` set;
   every later beat keeps it, and routers skip the node.
4. `stop()` ends the thread and, by default, removes the registration.

If the process dies, the registration expires after node_ttl_s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec

from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import NodeInfo

logger = logging.getLogger(__name__)


class Heartbeat:
    """Keeps a node registered: registers on `start()`, refreshes every node_ttl_s/3 until `stop()`.

    Args:
        directory: where to register.
        info_fn: the node's current NodeInfo (its load fields change between beats).
        interval_s: time between beats; node_ttl_s/3 by default.
        on_beat: run after each beat (not the first registration) on the heartbeat thread.
        on_restored: run after a beat that found the directory had lost the node (Redis restarted empty).
    """

    def __init__(self, directory: KVDirectory, info_fn: Callable[[], NodeInfo], *,
                 interval_s: float | None = None, on_beat: Callable[[], None] = lambda: None,
                 on_restored: Callable[[], None] = lambda: None):  # fmt: skip
        self._directory = directory
        self._info_fn = info_fn
        self._on_beat = on_beat
        self._on_restored = on_restored
        self._interval_s = interval_s if interval_s is not None else directory.node_ttl_s / 3
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._node_id: str | None = None
        self._draining = False
        self._write_lock = threading.Lock()  # a beat stamped before mark_draining must not land after it

    def start(self) -> None:
        """Register the node now, then keep refreshing it from a daemon thread.

        Raises:
            DirectoryError: the first registration failed (later failures are only logged).
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError(f"heartbeat of node {self._node_id} already started")
        info = self._stamped()
        self._directory.register_node(info)
        self._node_id = info.node_id
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{info.node_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                with self._write_lock:
                    restored = self._directory.heartbeat(self._stamped())
                if restored:
                    logger.warning("node %s: the directory had lost this node (Redis restarted without its data); "
                                   "registered again", self._node_id)
                    self._on_restored()
                self._on_beat()
            except Exception:  # noqa: BLE001 - the beat must outlive any single failure
                logger.exception("heartbeat of node %s failed; retrying in %.2fs", self._node_id, self._interval_s)

    def _stamped(self) -> NodeInfo:
        """The node's NodeInfo, stamped with this beat's time (`kvwire status` shows its age)."""
        return msgspec.structs.replace(self._info_fn(), heartbeat_at=time.time(), draining=self._draining)

    def mark_draining(self) -> None:
        """Mark the node draining in the directory now; every later beat keeps the mark.

        Raises:
            DirectoryError: the directory could not be written (later beats retry).
        """
        self._draining = True
        with self._write_lock:
            self._directory.heartbeat(self._stamped())
        logger.info("node %s marked draining", self._node_id)

    @property
    def draining(self) -> bool:
        return self._draining

    def stop(self, *, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop beating and, by default, remove the node's registration at once.

        Args:
            deregister: remove the registration now rather than let it expire.
            timeout_s: how long to wait for a beat in progress.
        Raises:
            DirectoryError: deregistration failed.
        """
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("heartbeat thread of node %s still busy after %.1fs", self._node_id, timeout_s)
        self._thread = None
        if deregister and self._node_id is not None:
            self._directory.deregister_node(self._node_id)
