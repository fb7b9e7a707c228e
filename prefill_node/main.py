"""Entry point of a prefill node process."""

from __future__ import annotations

from connectors.config import NodeConfig, NodeRole
from engine.node_runtime import run_node
from prefill_node.server import PrefillNode


def run(config: NodeConfig) -> None:
    assert config.connector.role == NodeRole.PREFILL
    run_node(config, PrefillNode)
