"""The vllm overlay: vLLM's OpenAI server in a prefill and a decode pool, the kvwire router in front.

The pools' argv is run through the parsers that read it in the pods: kvwire's connector
settings (`VLLMSettings.parse`) and, where vLLM is installed, vLLM's own argument parser,
which also checks every key of the --kv-transfer-config JSON.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from deploy_manifests import DEPLOY, Container, by_kind, containers, kubectl, render, selects, write_overlay

ROLES = {"kvwire-vllm-prefill": "kv_producer", "kvwire-vllm-decode": "kv_consumer"}
VLLM_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
# Stand-ins for the values only the cluster knows (downward API, Secret), to expand the argv.
STAND_INS = {"POD_IP": "10.1.2.3", "VLLM_HOST_IP": "10.1.2.3", "REDIS_PASSWORD": "0123abcd",
             "KVWIRE_REDIS_URL": "rediss://:4567ef@redis.example.com:6380/0"}  # the last: external Redis


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    kubectl()
    return render(DEPLOY / "overlays" / "vllm")


def _pool(objects: list[dict], name: str) -> Container:
    return next(c for c in containers(objects) if c.workload == name and c.spec["name"] == "vllm")


def _in_cluster(container: Container) -> Container:
    """`container` with STAND_INS for the values the kubelet would fill in."""
    env = dict(container.env)
    for item in container.spec.get("env", []):  # in order: a value may refer to those before it
        if "valueFrom" in item:
            env[item["name"]] = STAND_INS[item["name"]]
        else:
            env[item["name"]] = Container("", {}, env).expand(str(item.get("value", "")))
    return Container(container.workload, container.spec, env)


def _argv(container: Container) -> list[str]:
    """The argv the pool's process gets, every $(VAR) expanded."""
    cluster = _in_cluster(container)
    argv = [cluster.expand(token) for token in container.argv]
    assert None not in argv, argv
    return argv


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times"
    return argv[argv.index(flag) + 1]


def _kv_transfer_config(container: Container) -> dict:
    return json.loads(_value(_argv(container), "--kv-transfer-config"))


def test_vllm_pools_replace_kvwire_nodes(objects):
    assert not [c for c in containers(objects) if c.argv[:2] in (["kvwire", "prefill"], ["kvwire", "decode"])]
    for name in ROLES:
        pool = _pool(objects, name)
        pod = by_kind(objects, "Deployment")[name]["spec"]["template"]["spec"]
        assert pool.spec["command"] == VLLM_SERVER and pool.spec["image"] == "kvwire:vllm"
        argv, ports = _argv(pool), {p["name"]: p["containerPort"] for p in pool.spec["ports"]}
        assert int(_value(argv, "--port")) == ports["http"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert pool.spec[probe]["httpGet"] == {"path": "/health", "port": "http"}
        tp = int(_value(argv, "--tensor-parallel-size")) if "--tensor-parallel-size" in argv else 1
        for resources in (pool.spec["resources"]["requests"], pool.spec["resources"]["limits"]):
            assert resources["nvidia.com/gpu"] == str(tp), "one GPU per tensor-parallel rank"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        models = next(v for v in pod["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"] == {"claimName": "kvwire-models", "readOnly": True}
        mount = next(m for m in pool.spec["volumeMounts"] if m["name"] == "models")
        assert _value(argv, "--model").startswith(mount["mountPath"] + "/")
        env = {e["name"]: e for e in pool.spec["env"]}
        assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    prefill, decode = (_argv(_pool(objects, name)) for name in ROLES)
    for flag in ("--model", "--served-model-name"):  # KV computed by one model is only good for the same model
        assert _value(prefill, flag) == _value(decode, flag)
    assert _value(prefill, "--tensor-parallel-size") == "2" and "--tensor-parallel-size" not in decode, \
        "the overlay shows a TP=2 prefill pool feeding a TP=1 decode pool"


def test_kv_transfer_config_loads_kvwire_in_the_pools_role(objects):
    services = by_kind(objects, "Service")
    for name, role in ROLES.items():
        config = _kv_transfer_config(_pool(objects, name))
        assert {k: v for k, v in config.items() if k != "kv_connector_extra_config"} == {
            "kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.connectors.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute"}
        extra = config["kv_connector_extra_config"]
        assert extra["host"] == STAND_INS["POD_IP"]  # peers pull from the pod IP it advertises
        assert extra["transport"] == "ucx"
        redis = urlsplit(extra["redis_url"])
        assert (redis.scheme, redis.password, redis.path) == ("redis", STAND_INS["REDIS_PASSWORD"], "/0")
        assert redis.port in {p["port"] for p in services[redis.hostname]["spec"]["ports"]}


def test_kvwire_connector_accepts_the_extra_config(objects, tmp_path):
    # Unknown keys make the connector refuse to start: this catches a misspelt key before a pod does.
    settings = pytest.importorskip("kvwire.connectors.vllm.settings")
    secret = tmp_path / "auth-secret"
    secret.write_text("s" * 32)
    for name, role in ROLES.items():
        pool = _pool(objects, name)
        config = _kv_transfer_config(pool)
        extra = config["kv_connector_extra_config"]
        mounts = {m["mountPath"]: m["name"] for m in pool.spec["volumeMounts"]}
        mounted = mounts.get(str(Path(extra["auth_secret_file"]).parent))
        workload = next(o for o in objects if o["metadata"]["name"] == name and "template" in o.get("spec", {}))
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert mounted and volumes[mounted]["secret"]["secretName"] == "kvwire-secrets", f"{name}: the secret's mount"
        engine = pytest.importorskip("kvwire.connectors.vllm.identity").EngineShape("00000000-0000-0000-0000-0")
        parsed = settings.VLLMSettings.parse(config["kv_role"], {**extra, "auth_secret_file": str(secret)}, engine)
        assert parsed.role == role and parsed.host == STAND_INS["POD_IP"] and parsed.transport == "ucx"
        assert parsed.auth_secret == b"s" * 32


def test_vllm_accepts_the_pools_argv(objects):
    pytest.importorskip("vllm", reason="vLLM is not installed here (.venv-vllm has it)")
    try:  # vLLM >= 0.3x moved the server's parser out of entrypoints.openai
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name, role in ROLES.items():
        argv = _argv(_pool(objects, name))
        assert argv[:3] == VLLM_SERVER
        try:
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
        except SystemExit:
            pytest.fail(f"{name}: vLLM rejects its argv (the reason is in the captured stderr)")
        config = args.kv_transfer_config
        assert config.kv_role == role and config.kv_load_failure_policy == "recompute"
        module = importlib.import_module(config.kv_connector_module_path)
        assert hasattr(module, config.kv_connector), f"{module.__name__} has no {config.kv_connector}"


def test_router_fronts_each_pool_through_its_service(objects):
    router = next(c for c in containers(objects) if c.workload == "kvwire-router")
    services, deployments = by_kind(objects, "Service"), by_kind(objects, "Deployment")
    for flag, name in (("--vllm-prefill", "kvwire-vllm-prefill"), ("--vllm-decode", "kvwire-vllm-decode")):
        url = urlsplit(_value(router.argv, flag))
        service = services[url.hostname]["spec"]
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert selects({"matchLabels": service["selector"]}, pod_labels)
        port = next(p for p in service["ports"] if p["port"] == url.port)
        pool = _pool(objects, name)
        target = next(p["containerPort"] for p in pool.spec["ports"] if p["name"] == port["targetPort"])
        assert (url.scheme, url.path, target) == ("http", "", int(_value(_argv(pool), "--port")))
    # The router refuses kvwire's own nodes' options next to --vllm-*.
    assert not {"--model", "--redis-url", "--auth-secret-file"} & set(router.argv)


def test_network_policy_admits_only_kvwire_pods_to_the_pools(objects):
    policy = by_kind(objects, "NetworkPolicy")["kvwire-nodes"]["spec"]
    for name in ROLES:
        labels = by_kind(objects, "Deployment")[name]["spec"]["template"]["metadata"]["labels"]
        assert selects(policy["podSelector"], labels)


def test_external_redis_component_points_the_pools_at_it(tmp_path):
    kubectl()
    objects = render(write_overlay(tmp_path, "resources: [DEPLOY/overlays/vllm]\n"
                                             "components: [DEPLOY/components/external-redis]\n"))
    for name in ROLES:
        pod = by_kind(objects, "Deployment")[name]["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["vllm"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["KVWIRE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "kvwire-secrets", "key": "redis-url"}
        assert "REDIS_PASSWORD" not in env
        extra = _kv_transfer_config(_pool(objects, name))["kv_connector_extra_config"]
        assert extra["redis_url"] == STAND_INS["KVWIRE_REDIS_URL"]
