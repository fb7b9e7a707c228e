"""Entry point of a prefill node process."""

from __future__ import annotations

from kvwire.connectors.config import NodeRole
from kvwire.node.config import NodeConfig
from kvwire.node.runtime import run_node
from kvwire.prefill_node.server import PrefillNode


def run(config: NodeConfig) -> None:
    assert config.connector.role == NodeRole.PREFILL
    run_node(config, PrefillNode)
