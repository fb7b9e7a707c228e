"""A node's graceful shutdown (drain), shared by the prefill and decode nodes.

1. The serve loop calls `begin()` once its stop event is set (SIGTERM or SIGINT): the
   node is marked draining in the directory at once (routers stop picking it) and the
   grace period, config.drain_timeout_s, starts.
2. While draining, the node finishes what it holds, and work that still arrives (routed
   just before the mark landed) is `forward`ed to another live node of the same role,
   keeping its reply endpoint, so the router never notices.
3. When the node holds nothing more, or the grace period ends (`expired()`), the serve
   loop gives up what is left and returns; the node is deregistered and closed, and the
   process exits 0.
"""

from __future__ import annotations

import logging
import time

from kvwire.connectors.control.sockets import PushSockets
from kvwire.connectors.directory.directory import DirectoryError
from kvwire.connectors.wire import NodeInfo
from kvwire.node.runtime import NodeRuntime
from kvwire.protocol.work import DecodeWork, PrefillWork

log = logging.getLogger(__name__)


class Drain:
    """Tracks one node's drain: when it began, when it must end, where new work goes meanwhile."""

    def __init__(self, rt: NodeRuntime):
        self._rt = rt
        self._deadline: float | None = None
        self._nodes = PushSockets()  # forwarded work still goes out as the process exits (their linger)

    @property
    def active(self) -> bool:
        return self._deadline is not None

    def begin(self) -> None:
        """Mark the node draining in the directory and start the grace period (idempotent)."""
        if self._deadline is not None:
            return
        cfg = self._rt.config
        self._deadline = time.monotonic() + cfg.drain_timeout_s
        log.info("node %s draining: finishing held work within %.1fs", cfg.node_id, cfg.drain_timeout_s)
        try:
            if self._rt.heartbeat is not None:
                self._rt.heartbeat.mark_draining()
        except DirectoryError as exc:  # routers keep picking us until a later beat lands; we forward
            log.warning("node %s: cannot mark itself draining: %s", cfg.node_id, exc)

    def expired(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def remaining_ms(self) -> int | None:
        """Milliseconds left of the grace period (a poll timeout); None when not draining."""
        if self._deadline is None:
            return None
        return max(0, int((self._deadline - time.monotonic()) * 1000) + 1)

    def forward(self, work: PrefillWork | DecodeWork) -> str | None:
        """Hand work that arrived while draining to the least loaded other live node of our role.

        Returns:
            The node it went to; None if there is none (or the directory cannot say).
        """
        target = self._pick()
        if target is None:
            return None
        self._nodes.send(target.work_endpoint, work)
        log.info("request %s: node %s is draining; forwarded to %s", work.request_id, self._rt.config.node_id,
                 target.node_id)
        return target.node_id

    def _pick(self) -> NodeInfo | None:
        cfg = self._rt.config
        try:
            nodes = self._rt.directory.live_nodes(cfg.connector.role)  # draining nodes left out
        except DirectoryError as exc:
            log.warning("node %s: cannot list nodes to forward to: %s", cfg.node_id, exc)
            return None
        others = [n for n in nodes if n.node_id != cfg.node_id]
        return max(others, key=lambda n: n.free_blocks, default=None)

    def close(self) -> None:
        self._nodes.close()
