"""Entry point of a decode node process."""

from __future__ import annotations

from connectors.config import NodeConfig, NodeRole
from decode_node.server import DecodeNode
from engine.node_runtime import NodeRuntime, serve_until_signalled


def run(config: NodeConfig) -> None:
    assert config.connector.role == NodeRole.DECODE
    rt = NodeRuntime.start(config)
    serve_until_signalled(rt, DecodeNode(rt))
