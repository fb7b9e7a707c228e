"""What `pip install` puts on the path: one `kvwire` package, its folders as subpackages in layers, no import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The layers, bottom first: a module imports only from its own package or a layer below (README, "Layout").
# The two nodes share a layer and import nothing of each other.
LAYERS = (("observability",), ("connectors",), ("protocol",), ("engine",), ("node",), ("prefill_node", "decode_node"),
          ("router",), ("cluster",), ("bench",), ("cli",))
SUBPACKAGES = tuple(sorted(p for layer in LAYERS for p in layer))
# Inside connectors/, bottom first, the same rule: the core (its top-level modules that hold data and small
# tools), the control plane and the directory, the transports (their contract included), the two roles and the
# factory that builds a transport by name, the faces over the roles, then what a process opens on top.
CONNECTOR_LAYERS = (("core",), ("control", "directory"), ("transports",), ("producer", "consumer", "factory"),
                    ("connector", "self_test"), ("standalone", "vllm"))
CONNECTOR_CORE = {"__init__", "base", "config", "types", "wire", "kv_pool", "hidden", "model_input", "spin", "wakeup",
                  "deferred", "checkpoint", "prompt"}


def _package_dirs() -> list[Path]:
    return sorted(p.parent for top in SUBPACKAGES if (ROOT / top).is_dir()
                  for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("kvwire", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_every_folder_with_an_init_is_an_installed_subpackage():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    wanted = {_module_name(d / "__init__.py") for d in _package_dirs()} | {"kvwire"}
    assert listed == wanted


def test_the_installed_package_is_kvwire_and_nothing_generic():
    """Run from outside the checkout, so that only what is installed can be imported."""
    code = ("import importlib.util, kvwire.connectors, kvwire.engine.model;"
            f"print([m for m in {SUBPACKAGES!r} if importlib.util.find_spec(m) is not None])")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"generic top-level modules installed: {done.stdout}"


def test_kvwire_is_a_regular_package_with_a_version_and_only_its_own_folders():
    """`kvwire` has a docstring and pyproject's version; the repository's tests, deploy and docs folders do not
    import as kvwire's (run from outside the checkout, as a user would)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    code = ("import importlib, kvwire\n"
            "print(kvwire.__file__, kvwire.__version__, bool(kvwire.__doc__))\n"
            "for name in ('kvwire.tests', 'kvwire.deploy', 'kvwire.docs', 'kvwire.tests.procs'):\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "        print('imported', name)\n"
            "    except ModuleNotFoundError:\n"
            "        pass\n")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "__init__.py"), version, "True"]


def _runtime_imports(path: Path, type_checking: bool = False) -> set[str]:
    """kvwire modules `path` imports when it runs, at the top or inside a function (imports under
    `if TYPE_CHECKING:` too where `type_checking`)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
        for child in node.body for n in ast.walk(child)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvwire.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvwire.") and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the kvwire modules it imports at run time (a package's import counts as its __init__)."""
    files = {_module_name(p): p for d in _package_dirs() for p in d.glob("*.py")}
    return {mod: {m for m in _runtime_imports(path, type_checking) if m in files and m != mod}
            for mod, path in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a layer above the importer's, or in another package of its layer."""
    rank = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    out = []
    for mod, deps in sorted(graph.items()):
        here = mod.split(".")[1]
        out += [f"{mod} -> {dep}" for dep in sorted(deps)
                if (there := dep.split(".")[1]) != here and rank[there] >= rank[here]]
    return out


def _connectors_unit(mod: str) -> str | None:
    """Which of CONNECTOR_LAYERS' units a module of kvwire.connectors is in (None: outside connectors/)."""
    parts = mod.split(".")
    if parts[1] != "connectors":
        return None
    name = parts[2] if len(parts) > 2 else "__init__"
    return "core" if name in CONNECTOR_CORE else name


def upward_imports_in_connectors(graph: dict[str, set[str]]) -> list[str]:
    """Every import inside connectors/ of a unit in a layer above the importer's, or of another unit of its layer."""
    rank = {unit: i for i, layer in enumerate(CONNECTOR_LAYERS) for unit in layer}
    out = []
    for mod, deps in sorted(graph.items()):
        here = _connectors_unit(mod)
        if here is None:
            continue
        out += [f"{mod} -> {dep}" for dep in sorted(deps)
                if (there := _connectors_unit(dep)) is not None and there != here and rank[there] >= rank[here]]
    return out


def test_every_unit_of_connectors_has_a_layer():
    units = {_connectors_unit(m) for m in import_graph()} - {None}
    assert units == {u for layer in CONNECTOR_LAYERS for u in layer}


def test_imports_inside_connectors_only_go_down():
    """No transport imports a role, no role the faces over it (type-only imports count)."""
    assert upward_imports_in_connectors(import_graph(type_checking=True)) == []


def test_the_connectors_layer_check_sees_an_upward_import():
    graph = import_graph(type_checking=True)
    graph["kvwire.connectors.transports.ucx.flows"] |= {"kvwire.connectors.producer.layer_gate"}
    graph["kvwire.connectors.producer.role"] |= {"kvwire.connectors.consumer.role"}
    graph["kvwire.connectors.wire"] |= {"kvwire.connectors.directory.directory"}
    assert upward_imports_in_connectors(graph) == [
        "kvwire.connectors.producer.role -> kvwire.connectors.consumer.role",
        "kvwire.connectors.transports.ucx.flows -> kvwire.connectors.producer.layer_gate",
        "kvwire.connectors.wire -> kvwire.connectors.directory.directory"]


def test_imports_only_go_down():
    """Lazy imports (inside functions) and type-only ones count: a layer names nothing above it."""
    assert upward_imports(import_graph(type_checking=True)) == []


def test_the_layer_check_sees_an_upward_import():
    graph = import_graph(type_checking=True)
    graph["kvwire.engine.model"] = graph["kvwire.engine.model"] | {"kvwire.router.app"}
    graph["kvwire.prefill_node.server"] = graph["kvwire.prefill_node.server"] | {"kvwire.decode_node.server"}
    assert upward_imports(graph) == ["kvwire.engine.model -> kvwire.router.app",
                                     "kvwire.prefill_node.server -> kvwire.decode_node.server"]


def test_no_module_imports_a_top_level_sibling_by_its_old_name():
    bad = []
    for d in _package_dirs():
        for path in d.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in SUBPACKAGES]
    assert not bad


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_cli_and_the_router_start_without_torch():
    """`kvwire router` (and `status`, `redis`) import no torch: seconds off every router start."""
    code = ("import sys, kvwire.cli.main, kvwire.router.app, kvwire.router.vllm.proxy;"
            "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
