"""Entry point of a decode node process."""

from __future__ import annotations

from kvwire.connectors.config import NodeRole
from kvwire.decode_node.server import DecodeNode
from kvwire.node.config import NodeConfig
from kvwire.node.runtime import run_node


def run(config: NodeConfig) -> None:
    assert config.connector.role == NodeRole.DECODE
    run_node(config, DecodeNode)
