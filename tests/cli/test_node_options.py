"""`kvwire prefill` / `kvwire decode` options reach the node's one config object."""

from __future__ import annotations

import pytest
import typer

from kvwire.cli.options import node_config
from kvwire.connectors.config import ConnectorKind, NodeRole


def _config(model_dir, connector=ConnectorKind.UCX, **kw):
    return node_config(NodeRole.DECODE, model=model_dir, redis_url="redis://127.0.0.1:1", host="127.0.0.1", port=0,
                       node_id="d", connector=connector, block_size=16, num_blocks=8, kv_deadline=1.0,
                       max_model_len=0, torch_threads=1, **({"device": "cpu"} | kw))


def test_pull_lanes_reach_the_connector_config(tiny_model_dir):
    assert _config(tiny_model_dir).connector.pull_lanes == 2
    assert _config(tiny_model_dir, pull_lanes=5).connector.pull_lanes == 5


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(typer.BadParameter, match="config.json"):
        _config(tmp_path)


def test_layerwise_reaches_the_config_and_needs_tcp_or_ucx(tiny_model_dir):
    assert _config(tiny_model_dir, connector=ConnectorKind.TCP, layerwise=True).connector.layerwise
    assert _config(tiny_model_dir, connector=ConnectorKind.UCX, layerwise=True).connector.layerwise
    with pytest.raises(typer.BadParameter, match="tcp and ucx connectors"):
        _config(tiny_model_dir, connector=ConnectorKind.SHM, layerwise=True)


def test_redis_timeout_and_directory_wait_reach_the_config(tiny_model_dir):
    assert _config(tiny_model_dir).redis_timeout_s == 5.0
    assert _config(tiny_model_dir, redis_timeout=1.5).redis_timeout_s == 1.5
    assert _config(tiny_model_dir).directory_wait_s == 60.0
    assert _config(tiny_model_dir, directory_wait=2.5).directory_wait_s == 2.5


def test_a_device_this_machine_lacks_is_refused_before_anything_starts(tiny_model_dir):
    import torch

    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    with pytest.raises(typer.BadParameter, match=f"no CUDA device {missing}"):
        _config(tiny_model_dir, device=missing)
    with pytest.raises(typer.BadParameter, match="not meta"):
        _config(tiny_model_dir, device="meta")


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(("flag", "want"), [([], True), (["--no-prefix-cache"], False), (["--prefix-cache"], True)])
def test_a_node_keeps_a_prefix_cache_unless_told_not_to(role, flag, want, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from kvwire.cli.main import app

    built = []
    monkeypatch.setattr(f"kvwire.{role}_node.main.run", built.append)
    result = CliRunner().invoke(app, [role, "--model", str(tiny_model_dir), "--redis-url", "redis://127.0.0.1:1",
                                      *flag])
    assert result.exit_code == 0, result.output
    assert built[0].engine.prefix_cache is want


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(("flag", "want"), [([], True), (["--no-warmup"], False), (["--warmup"], True)])
def test_a_node_warms_up_unless_told_not_to(role, flag, want, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from kvwire.cli.main import app

    built = []
    monkeypatch.setattr(f"kvwire.{role}_node.main.run", built.append)
    result = CliRunner().invoke(app, [role, "--model", str(tiny_model_dir), "--redis-url", "redis://127.0.0.1:1",
                                      *flag])
    assert result.exit_code == 0, result.output
    assert built[0].warmup is want


def test_a_local_cluster_passes_no_warmup_to_both_nodes(tiny_model_dir):
    from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster

    for warmup in (True, False):
        cluster = LocalCluster(ClusterSpec(model_dir=tiny_model_dir, warmup=warmup))
        cluster.redis_url, cluster.http_ports = "redis://127.0.0.1:1", {"prefill": 1, "decode": 2}
        assert all(("--no-warmup" in cluster._node_args(name)) is not warmup for name in ("prefill", "decode"))
