"""Every `kvwire` command and flag the rendered manifests pass exists in the CLI."""

from __future__ import annotations

import pytest

from cli_argv import check_argv
from deploy_manifests import DEPLOY, OVERLAYS, Container, containers, kubectl, render

# The sub-commands each overlay must run: a check that found no argv would pass vacuously.
EXPECTED = {
    "cpu-demo": {"prefill", "decode", "router", "init-model"},
    "gpu": {"prefill", "decode", "router"},
    "rdma": {"prefill", "decode", "router"},
    "vllm": {"router"},  # the pools run vLLM; tests/deploy/test_deploy_vllm.py checks their argv
}


def _kvwire_containers(overlay: str) -> list[Container]:
    kubectl()
    return [c for c in containers(render(DEPLOY / "overlays" / overlay)) if c.argv[:1] == ["kvwire"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifest_argv_matches_cli(overlay):
    found = _kvwire_containers(overlay)
    assert {c.argv[1] for c in found} == EXPECTED[overlay]
    problems = [f"{c.workload}/{c.spec['name']}: {p}" for c in found for p in check_argv(c.argv, c.expand, c.env)]
    assert problems == [], "manifests pass what the CLI does not take:\n" + "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_is_defined(overlay):
    # The kubelet leaves an undefined $(VAR) in place: `--port $(TYPO)` would reach the CLI
    # (or the vLLM servers' JSON config). Every container, not only kvwire's.
    kubectl()
    objects = render(DEPLOY / "overlays" / overlay)
    undefined = {f"{c.workload}/{c.spec['name']}": c.undefined_refs() for c in containers(objects)}
    assert {k: v for k, v in undefined.items() if v} == {}


def test_checker_reports_unknown_flags_bad_values_and_repeats():
    env = {"KVWIRE_CONNECTOR": "carrier-pigeon", "KVWIRE_REDIS_URL": "redis://r:6379/0"}
    probe = Container("probe", {}, env)
    argv = ["kvwire", "prefill", "--model", "/m", "--no-such-flag", "1", "--connector", "$(KVWIRE_CONNECTOR)",
            "--port", "70000", "--log-level", "INFO", "--log-level", "DEBUG"]
    problems = "\n".join(check_argv(argv, probe.expand, env))
    assert "no such option --no-such-flag" in problems
    assert "--connector 'carrier-pigeon' rejected" in problems
    assert "--port '70000' rejected" in problems
    assert "--log-level given twice" in problems
    assert check_argv(["kvwire", "teleport"], probe.expand, env) == ["['kvwire', 'teleport']: no such kvwire sub-command"]


def test_checker_accepts_a_valid_argv_and_requires_what_the_cli_requires():
    env = {"KVWIRE_REDIS_URL": "redis://r:6379/0"}
    probe = Container("probe", {}, env)
    valid = ["kvwire", "decode", "--model=/m", "--connector", "ucx", "--device", "cuda:0", "--port", "5555"]
    assert check_argv(valid, probe.expand, env) == []
    missing = check_argv(["kvwire", "decode", "--port", "5555"], probe.expand, {})
    assert any("required option --model" in p for p in missing)
    assert any("required option --redis-url" in p for p in missing)
    assert check_argv(["kvwire", "init-model", "/models/tiny", "--seed", "0"], probe.expand, env) == []
    assert any("missing required argument" in p for p in check_argv(["kvwire", "init-model"], probe.expand, env))
