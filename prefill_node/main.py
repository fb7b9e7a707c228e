"""Entry point of a prefill node process."""

from __future__ import annotations

from connectors.config import NodeConfig, NodeRole
from engine.node_runtime import NodeRuntime, serve_until_signalled
from prefill_node.server import PrefillNode


def run(config: NodeConfig) -> None:
    assert config.connector.role == NodeRole.PREFILL
    rt = NodeRuntime.start(config)
    serve_until_signalled(rt, PrefillNode(rt))
