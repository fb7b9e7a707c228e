"""Each overlay renders with kustomize and holds what its README promises."""

from __future__ import annotations

import pytest

from deploy_manifests import (DEPLOY, NODE_OVERLAYS, OVERLAYS, by_kind, containers, kubectl, render, selects,
                              write_overlay)

NODES = ("kvwire-prefill", "kvwire-decode")
KVWIRE = NODES + ("kvwire-router",)
VLLM = ("kvwire-vllm-prefill", "kvwire-vllm-decode")
# Paths the liveness and readiness probes of each server's main container must ask.
PROBE_PATHS = {"kvwire": ("/healthz", "/readyz"), "vllm": ("/health", "/health")}


@pytest.fixture(autouse=True)
def _needs_kubectl():
    kubectl()


def _overlay(name: str) -> list[dict]:
    return render(DEPLOY / "overlays" / name)


def _main(objects: list[dict], deployment: str):
    return next(c for c in containers(objects) if c.workload == deployment and c.spec["name"] == "kvwire")


def _flag(container, flag: str) -> str | None:
    argv = container.argv
    return container.expand(argv[argv.index(flag) + 1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_probes_requests_pdb_and_spread(overlay):
    objects = _overlay(overlay)
    deployments, pdbs = by_kind(objects, "Deployment"), by_kind(objects, "PodDisruptionBudget")
    assert set(deployments) == {"kvwire-redis", "kvwire-router", *(VLLM if overlay == "vllm" else NODES)}
    assert {"kvwire-router", "kvwire-redis"} <= set(by_kind(objects, "Service"))
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert [p for p in pdbs.values() if selects(p["spec"]["selector"], labels)] == [pdbs[name]]
        pod = deployment["spec"]["template"]["spec"]
        for c in pod["containers"]:
            assert {"livenessProbe", "readinessProbe"} <= set(c), f"{name} lacks probes"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), f"{name} lacks requests"
        if name != "kvwire-redis":
            assert selects(pod["topologySpreadConstraints"][0]["labelSelector"], labels)
            probes = pod["containers"][0]
            liveness, readiness = PROBE_PATHS[probes["name"]]
            assert probes["livenessProbe"]["httpGet"]["path"] == liveness
            assert probes["readinessProbe"]["httpGet"]["path"] == readiness


@pytest.mark.parametrize("overlay", NODE_OVERLAYS)
def test_nodes_advertise_pod_ip_and_serve_http_on_the_probed_port(overlay):
    objects = _overlay(overlay)
    for name in NODES:
        node = _main(objects, name)
        assert node.spec["args"][node.spec["args"].index("--host") + 1] == "$(POD_IP)"
        assert _flag(node, "--node-id") is None  # the pod name, known only in the cluster
        ports = {p["name"]: p["containerPort"] for p in node.spec["ports"]}
        assert int(_flag(node, "--http-port")) == ports["http"]
        assert int(_flag(node, "--port")) == ports["work"]


def test_cpu_demo_writes_the_tiny_model_before_every_kvwire_container():
    objects = _overlay("cpu-demo")
    for name in KVWIRE:
        pod = by_kind(objects, "Deployment")[name]["spec"]["template"]["spec"]
        init = pod["initContainers"][0]
        assert init["command"] == ["kvwire", "init-model", "/models/tiny", "--preset", "tiny", "--seed", "0"]
        assert init["image"] == "kvwire:cpu"  # init-model needs the node extra, the router's image lacks it
        assert pod["containers"][0]["image"] == ("kvwire-router:lean" if name == "kvwire-router" else "kvwire:cpu")
        assert _flag(_main(objects, name), "--model") == "/models/tiny"
        assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "models")


def test_gpu_gives_each_node_one_gpu_and_cuda_0():
    objects = _overlay("gpu")
    for name in NODES:
        node = _main(objects, name)
        assert node.spec["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert _flag(node, "--device") == "cuda:0"
        assert node.spec["image"] == "kvwire:gpu"
    router = by_kind(objects, "Deployment")["kvwire-router"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in router["containers"][0]["resources"].get("limits", {})
    assert next(v for v in router["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["readOnly"]


def test_rdma_uses_ucx_over_the_rdma_nic():
    objects = _overlay("rdma")
    for name in NODES:
        node = _main(objects, name)
        template = by_kind(objects, "Deployment")[name]["spec"]["template"]
        assert _flag(node, "--connector") == "ucx"
        assert node.env["UCX_TLS"].split(",")[0] == "rc" and node.env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert "IPC_LOCK" in node.spec["securityContext"]["capabilities"]["add"]
        assert node.spec["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
    assert _flag(_main(objects, "kvwire-router"), "--model") == "/models/model"


def test_external_redis_component_drops_in_cluster_redis(tmp_path):
    objects = render(write_overlay(tmp_path, "resources: [DEPLOY/overlays/gpu]\n"
                                             "components: [DEPLOY/components/external-redis]\n"))
    assert not [o for o in objects if o["metadata"]["name"] == "kvwire-redis"]
    secret = by_kind(objects, "Secret")["kvwire-secrets"]
    assert secret["stringData"]["redis-url"].startswith("rediss://")
    for c in containers(objects):
        if c.spec["name"] == "kvwire":
            env = {e["name"]: e for e in c.spec["env"]}
            assert env["KVWIRE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "kvwire-secrets", "key": "redis-url"}
            assert "REDIS_PASSWORD" not in env


def test_secret_generator_replaces_the_placeholders(tmp_path):
    # The recipe of deploy/README.md: an overlay of yours with the real values.
    (tmp_path / "secrets.env").write_text("auth-secret=0123abcd\nredis-password=4567ef\n")
    objects = render(write_overlay(tmp_path, "resources: [DEPLOY/overlays/cpu-demo]\nsecretGenerator:\n"
                                             "  - {name: kvwire-secrets, behavior: replace, envs: [secrets.env]}\n"))
    secrets = by_kind(objects, "Secret")
    assert len(secrets) == 1
    (name, secret), = secrets.items()
    assert "CHANGE-ME" not in str(secret) and "stringData" not in secret and set(secret["data"]) == {
        "auth-secret", "redis-password"}
    refs = {v["secret"]["secretName"] for d in by_kind(objects, "Deployment").values()
            for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert refs == {name}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_runs_the_lean_image_in_every_overlay(overlay):
    assert _main(_overlay(overlay), "kvwire-router").spec["image"] == "kvwire-router:lean"
