"""Helpers of the deploy tests: render the kustomize overlays, walk their containers.

Rendering shells out to `kubectl kustomize` (kustomize 5); tests that need it skip with
a reason where kubectl is missing. Everything else reads plain YAML.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "base"
OVERLAYS = ("cpu-demo", "gpu", "rdma", "vllm")
# The overlays that run kvwire's own prefill and decode nodes (vllm runs vLLM servers).
NODE_OVERLAYS = ("cpu-demo", "gpu", "rdma")
# Kubernetes version whose API schema the manifests must satisfy (kubernetes-validate
# ships it offline; kubectl here is 1.32 too).
K8S_VERSION = "1.32.0"

_VAR_RE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """Path of kubectl, or skip the calling test with the reason."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    return path


def render(directory: Path) -> list[dict]:
    """Render a kustomization with `kubectl kustomize` and return its objects.

    Raises:
        AssertionError: kustomize failed (its stderr is in the message).
    """
    return list(_render_cached(str(directory.resolve())))


@functools.lru_cache(maxsize=None)
def _render_cached(directory: str) -> tuple[dict, ...]:
    proc = subprocess.run([kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def load_file(path: Path) -> list[dict]:
    """The non-empty YAML documents of one file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base_resource_files() -> list[Path]:
    """The base's Kubernetes object files (everything but kustomization.yaml)."""
    return sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


def write_overlay(directory: Path, text: str) -> Path:
    """Write a kustomization.yaml into `directory`, with DEPLOY replaced by the relative path
    of deploy/ (kustomize takes no absolute resource paths); returns `directory`."""
    rel = os.path.relpath(DEPLOY, directory)
    (directory / "kustomization.yaml").write_text(text.replace("DEPLOY", rel))
    return directory


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects `labels`."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions), "selects() knows only the In operator"
    return (all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
            and all(labels.get(e["key"]) in e["values"] for e in expressions))


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    """Objects of one kind, by metadata.name."""
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@dataclass(frozen=True)
class Container:
    """One container (or initContainer) of a rendered workload, with its environment."""

    workload: str
    spec: dict
    env: dict[str, str | None]  # name -> literal value, None where only the cluster knows it

    @property
    def argv(self) -> list[str]:
        return [str(a) for a in self.spec.get("command", []) + self.spec.get("args", [])]

    def expand(self, token: str) -> str | None:
        """`token` with $(VAR) references expanded as the kubelet does; None if unknowable."""
        unknown = False

        def sub(match: re.Match) -> str:
            nonlocal unknown
            value = self.env.get(match.group(1))
            unknown |= value is None
            return value or ""

        expanded = _VAR_RE.sub(sub, token)
        return None if unknown else expanded

    def undefined_refs(self) -> list[str]:
        """$(VAR) references in argv and env values that the container does not define."""
        tokens = self.argv + [e.get("value", "") for e in self.spec.get("env", [])]
        return [v for t in tokens for v in _VAR_RE.findall(t) if v not in self.env]


def containers(objects: list[dict]) -> Iterator[Container]:
    """Every container and initContainer of every Deployment in `objects`."""
    config_maps = {name: cm.get("data", {}) for name, cm in by_kind(objects, "ConfigMap").items()}
    for name, deployment in by_kind(objects, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        for spec in pod.get("initContainers", []) + pod["containers"]:
            yield Container(name, spec, _environment(spec, config_maps))


def _environment(spec: dict, config_maps: dict[str, dict]) -> dict[str, str | None]:
    env: dict[str, str | None] = {}
    for source in spec.get("envFrom", []):
        ref = source.get("configMapRef")  # a secretRef's keys are known only in the cluster
        if ref is not None:
            env.update(config_maps.get(ref["name"], {}))
    for item in spec.get("env", []):
        value_from = item.get("valueFrom", {})
        if "configMapKeyRef" in value_from:
            ref = value_from["configMapKeyRef"]
            env[item["name"]] = config_maps.get(ref["name"], {}).get(ref["key"])
        elif value_from:
            env[item["name"]] = None
        else:  # may refer to variables defined before it, as the kubelet allows
            env[item["name"]] = Container("", {}, env).expand(str(item.get("value", "")))
    return env
