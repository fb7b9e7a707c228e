"""kvwire: disaggregated prefill/decode KV transfer (README.md has the map of its folders).

The repository's root is this package: its top-level folders are kvwire's subpackages. Three of
them belong to the repository, not the package (`tests`, `deploy`, `docs`): an editable install
would otherwise import them as `kvwire.tests` and so on, and a wheel does not ship them.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

__version__ = "0.1.0"  # pyproject.toml's version (tests/test_packaging.py checks they agree)

_REPOSITORY_FOLDERS = frozenset({"kvwire.tests", "kvwire.deploy", "kvwire.docs"})


class _RepositoryFolders(MetaPathFinder):
    """Refuses `kvwire.tests`, `kvwire.deploy` and `kvwire.docs`, which a wheel would not have."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _REPOSITORY_FOLDERS:
            raise ModuleNotFoundError(f"No module named {fullname!r}: the repository's folder, not part of kvwire",
                                      name=fullname)
        return None


if not any(type(f).__name__ == _RepositoryFolders.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _RepositoryFolders())
