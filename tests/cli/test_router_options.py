"""`kvwire router`'s choice between kvwire's nodes and vLLM servers, and its refusals."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvwire.cli.main import app
from kvwire.cli.router_cmd import vllm_urls

runner = CliRunner()
NO_ENV = {"KVWIRE_MODEL": None, "KVWIRE_REDIS_URL": None, "KVWIRE_VLLM_PREFILL": None, "KVWIRE_VLLM_DECODE": None,
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": None}


def _must_not_serve(*args, **kwargs):
    raise AssertionError("the router was about to serve")


@pytest.mark.parametrize("args, message", [
    (["--vllm-prefill", "http://p:8100"], "--vllm-prefill needs --vllm-decode"),
    (["--vllm-decode", "http://d:8200", "--model", "/tmp/m"], "--model: for kvwire's own nodes"),
    (["--vllm-decode", "http://d:8200", "--redis-url", "redis://r:6379/0"], "--redis-url: for kvwire's own nodes"),
    (["--vllm-decode", "d:8200"], "not a vLLM base URL"),
    (["--vllm-decode", "http://d:8200", "--otlp-traces-endpoint", "http://c:4318/v1/traces"],
     "--otlp-traces-endpoint: for kvwire's own nodes"),
    ([], "--model"),
    (["--model", "/tmp/m"], "--redis-url"),
    (["--model", "/tmp/m", "--redis-url", "redis://r:6379/0", "--instance-wait", "5", "--max-failures", "2"],
     "--instance-wait, --max-failures: for vLLM servers"),
])
def test_router_refuses_mixed_or_missing_modes(args, message, monkeypatch):
    monkeypatch.setattr("uvicorn.run", _must_not_serve)
    result = runner.invoke(app, ["router", *args], env=NO_ENV)
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


def test_redis_url_from_the_environment_does_not_clash_with_vllm_mode(monkeypatch):
    monkeypatch.setattr("uvicorn.run", _must_not_serve)
    env = {**NO_ENV, "KVWIRE_REDIS_URL": "redis://r:6379/0"}
    result = runner.invoke(app, ["router", "--vllm-prefill", "http://p:1"], env=env)
    assert result.exit_code == 2 and "--redis-url" not in result.output  # refused for its missing decode alone


def test_decode_alone_serves_in_vllm_mode(monkeypatch):
    served = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.append((app.title, kwargs["port"])))
    result = runner.invoke(app, ["router", "--vllm-decode", "http://d:8200/", "--port", "8123"], env=NO_ENV)
    assert result.exit_code == 0, result.output
    assert served == [("kvwire router (vLLM)", 8123)]


def test_vllm_mode_flags_reach_its_config(monkeypatch):
    served = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.append(app))
    monkeypatch.setattr("kvwire.router.vllm.proxy.create_vllm_app", lambda config: config)
    result = runner.invoke(app, ["router", "--vllm-decode", "http://d:1", "--instance-wait", "7", "--max-failures",
                                 "5", "--unresponsive-after", "9", "--connect-timeout", "0.5", "--health-interval",
                                 "3", "--request-timeout", "11", "--sequential", "--prefill-max-in-flight", "6"],
                           env=NO_ENV)
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.instance_wait_s, config.max_failures, config.unresponsive_s, config.connect_timeout_s,
            config.health_interval_s, config.request_timeout_s) == (7, 5, 9, 0.5, 3, 11)
    assert config.sequential and config.prefill_max_in_flight == 6


@pytest.mark.parametrize("args, want", [
    ([], (0, 0, "prefix", 120.0)),  # kvwire's own nodes: every prompt disaggregated, placed by prefix and load
    (["--decode-only-below", "64", "--prefill-max-in-flight", "3", "--routing", "load", "--prefix-ttl", "9"],
     (64, 3, "load", 9.0)),
])
def test_path_and_routing_flags_reach_the_own_nodes_config(args, want, monkeypatch):
    served = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.append(app))
    monkeypatch.setattr("kvwire.router.app.create_app", lambda config: config)
    monkeypatch.setattr("kvwire.engine.gc_pauses.freeze_startup_heap", lambda: None)
    result = runner.invoke(app, ["router", "--model", "/tmp/m", "--redis-url", "redis://r:6379/0", *args], env=NO_ENV)
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.decode_only_below, config.prefill_max_in_flight, config.routing, config.prefix_ttl_s) == want


def test_vllm_mode_keeps_its_decode_only_default(monkeypatch):
    served = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.append(app))
    monkeypatch.setattr("kvwire.router.vllm.proxy.create_vllm_app", lambda config: config)
    result = runner.invoke(app, ["router", "--vllm-decode", "http://d:1"], env=NO_ENV)
    assert result.exit_code == 0, result.output
    assert served[0].decode_only_below == 512


def test_scheduler_flags_reach_its_config(monkeypatch):
    served = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.append(app))
    monkeypatch.setattr("kvwire.router.vllm.proxy.create_vllm_app", lambda config: config)
    result = runner.invoke(app, ["router", "--vllm-decode", "http://d:1,http://e:1", "--routing", "load",
                                 "--decode-only-below", "64", "--prefix-ttl", "30", "--vllm-kv-events",
                                 "tcp://d:5557,"], env=NO_ENV)
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.routing, config.decode_only_below, config.prefix_ttl_s) == ("load", 64, 30)
    assert config.decode_kv_events == ("tcp://d:5557", "")
    refused = runner.invoke(app, ["router", "--vllm-decode", "http://d:1,http://e:1", "--vllm-kv-events",
                                  "tcp://d:5557"], env=NO_ENV)
    assert refused.exit_code == 2 and "1 KV event endpoints for 2 decode instances" in refused.output


@pytest.mark.parametrize("args, message", [
    (["--workload", "multiturn", "--rounds", "2"], "--rounds: for --workload mix"),
    (["--turns", "2"], "--turns: for --workload multiturn"),
    (["--workload", "multiturn", "--plain-url", "http://127.0.0.1:1"], "--plain-url: for --workload mix"),
    (["--plain-url", "http://127.0.0.1:1"], "give --model, the checkpoint the plain server at --plain-url serves"),
])
def test_bench_vllm_refuses_the_other_workload_s_options(args, message):
    result = runner.invoke(app, ["bench", "vllm", *args], env=NO_ENV)
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


def test_vllm_urls_split_on_commas_and_drop_trailing_slashes():
    assert vllm_urls(" http://a:1/, http://b:2,,") == ("http://a:1", "http://b:2")
