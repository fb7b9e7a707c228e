"""Peers' bytes are data: nothing in the product imports pickle or marshal, or calls torch.load / eval / exec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["connectors", "engine", "prefill_node", "decode_node", "router", "cli", "bench", "observability"]
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}
FORBIDDEN_CALLS = {("torch", "load"), ("", "eval"), ("", "exec")}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _offences(path: Path) -> list[str]:
    tree, out = ast.parse(path.read_text(), str(path)), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = ("", f.id) if isinstance(f, ast.Name) else \
                (f.value.id, f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if name in FORBIDDEN_CALLS:
                out.append(f"{'.'.join(filter(None, name))}() at line {node.lineno}")
    return out


def test_the_scan_sees_the_product():
    assert len(_sources()) > 50


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_deserializer_that_runs_code(path):
    assert _offences(path) == []


def test_the_scan_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch\nx = torch.load(b)\neval('1')\n")
    assert _offences(bad) == ["import pickle", "torch.load() at line 3", "eval() at line 4"]
