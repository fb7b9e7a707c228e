"""kvwire's requirements from pyproject.toml alone: the base and the extras named, one a line.

The Dockerfiles install these before they copy the source, so the dependency layer is rebuilt only when
pyproject.toml changes; `.ci/gpu pack` reads the extras through it too. An extra that names kvwire's own
(`all = ["kvwire[node,ucx-cu12,local]"]`) is expanded in place, as pip does. Standard library only: it
runs before anything is installed.

    python3 requirements.py pyproject.toml node ucx-cu12 > requirements.txt   # base, node, ucx-cu12
    python3 requirements.py pyproject.toml --no-base bench-cu13               # the bench-cu13 extra alone
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(project: dict, extras: list[str], base: bool = True) -> list[str]:
    """The requirement strings of the base (where `base`) and of `extras`, self-references expanded.

    Args:
        project: pyproject.toml's [project] table.
        extras: extra names, in order.
    Returns:
        Each requirement once, in the order met.
    Raises:
        KeyError: an extra pyproject does not have.
    """
    out = list(project["dependencies"]) if base else []
    todo, seen = list(extras), set()
    own = re.compile(rf"{re.escape(project['name'])}\[([^\]]+)\]\s*")
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in project["optional-dependencies"]:
            raise KeyError(f"Unsupported extra: {extra!r} (pyproject.toml has "
                           f"{', '.join(project['optional-dependencies'])})")
        for req in project["optional-dependencies"][extra]:
            if match := own.fullmatch(req):
                todo += [e.strip() for e in match.group(1).split(",")]
            else:
                out.append(req)
    return list(dict.fromkeys(out))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    base = "--no-base" not in argv
    path, *extras = [a for a in argv if a != "--no-base"]
    project = tomllib.loads(Path(path).read_text())["project"]
    try:
        print("\n".join(requirements(project, extras, base)))
    except KeyError as exc:
        print(f"requirements.py: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
