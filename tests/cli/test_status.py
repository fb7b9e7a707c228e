"""`kvwire status` as a command: table and JSON from a real directory, and its errors."""

from __future__ import annotations

import time

import msgspec
from typer.testing import CliRunner

from kvwire.cli.main import app
from kvwire.cluster.status import ClusterStatus
from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from tests.connectors.directory.test_directory import node

runner = CliRunner()


def _register(redis_url: str) -> None:
    directory = KVDirectory(redis_url)
    try:
        for node_id, role in (("prefill-0", NodeRole.PREFILL), ("decode-0", NodeRole.DECODE)):
            directory.register_node(msgspec.structs.replace(node(node_id, role), heartbeat_at=time.time()))
        directory.create_pending("cmpl-1", "prefill-0")
    finally:
        directory.close()


def test_json_lists_nodes_and_transfers(redis_url):
    _register(redis_url)
    result = runner.invoke(app, ["status", "--json"], env={"KVWIRE_REDIS_URL": redis_url})
    assert result.exit_code == 0, result.output
    status = msgspec.json.decode(result.output, type=ClusterStatus)
    assert [(n.node_id, n.role) for n in status.nodes] == [("decode-0", NodeRole.DECODE),
                                                           ("prefill-0", NodeRole.PREFILL)]
    assert all(n.heartbeat_age_s is not None and n.heartbeat_age_s < 5 for n in status.nodes)
    assert [t.request_id for t in status.transfers] == ["cmpl-1"]


def test_table_by_default(redis_url):
    _register(redis_url)
    result = runner.invoke(app, ["status", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert "nodes (2 live)" in result.output and "cmpl-1" in result.output


def test_redis_url_is_required_and_an_unreachable_directory_fails_cleanly():
    assert runner.invoke(app, ["status"], env={"KVWIRE_REDIS_URL": None}).exit_code == 2
    result = runner.invoke(app, ["status", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1 and "directory redis://127.0.0.1:1/0" in result.output
