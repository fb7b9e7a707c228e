"""The manifests satisfy the Kubernetes API schema (kubernetes-validate, strict mode).

Strict mode rejects unknown fields, so a misspelt or misplaced key fails here rather
than being dropped silently by the API server's pruning.
"""

from __future__ import annotations

import copy

import pytest

from deploy_manifests import (DEPLOY, K8S_VERSION, OVERLAYS, base_resource_files, kubectl, load_file, render,
                              write_overlay)

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (test extra)")


# The Prometheus Operator's kinds (deploy/observability): no Kubernetes schema knows them; what they hold is
# checked by promtool and a real Prometheus instead (tests/deploy/test_observability_manifests.py).
OPERATOR_API = "monitoring.coreos.com/v1"


def _schema_errors(objects: list[dict]) -> list[str]:
    errors = []
    for obj in objects:
        if obj.get("apiVersion") == OPERATOR_API:
            continue
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{where}: {exc.message}")
    return errors


@pytest.mark.parametrize("path", base_resource_files(), ids=lambda p: p.name)
def test_base_file_is_valid_on_its_own(path):
    objects = load_file(path)
    assert objects, f"{path} holds no objects"
    assert _schema_errors(objects) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_is_valid(overlay):
    kubectl()
    objects = render(DEPLOY / "overlays" / overlay)
    assert _schema_errors(objects) == []


def test_validator_rejects_unknown_and_mistyped_fields():
    # Proves the check above has teeth: strict mode must catch the typical slips.
    deployment = next(o for o in load_file(DEPLOY / "base" / "prefill.yaml") if o["kind"] == "Deployment")
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    mistyped = copy.deepcopy(deployment)
    mistyped["spec"]["replicas"] = "two"
    assert len(_schema_errors([unknown])) == 1
    assert "replicas" in _schema_errors([mistyped])[0]


@pytest.mark.parametrize("overlay", ["rdma", "vllm"])
def test_external_redis_variant_is_valid(tmp_path, overlay):
    kubectl()
    objects = render(write_overlay(tmp_path, f"resources: [DEPLOY/overlays/{overlay}]\n"
                                             "components: [DEPLOY/components/external-redis]\n"))
    assert "kvwire-redis" not in {o["metadata"]["name"] for o in objects}
    assert _schema_errors(objects) == []
