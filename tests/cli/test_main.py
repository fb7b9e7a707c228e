"""The `kvwire` command itself: its version, and shell completion, as a user's shell runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvwire import __version__

KVWIRE = str(Path(sys.executable).parent / "kvwire")  # the console script pip installed, as a shell runs it


def _kvwire(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KVWIRE, *args], capture_output=True, text=True, timeout=60, env=env)


def test_version_prints_the_package_version():
    done = _kvwire("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvwire {__version__}"


def test_bash_completion_completes_sub_commands():
    """What bash's completion script asks (typer's _KVWIRE_COMPLETE protocol) for `kvwire st<TAB>`."""
    env = {**os.environ, "_KVWIRE_COMPLETE": "complete_bash", "COMP_WORDS": "kvwire st", "COMP_CWORD": "1"}
    done = _kvwire(env=env)
    assert "status" in done.stdout.split(), (done.stdout, done.stderr)


def test_show_completion_prints_a_script():
    done = _kvwire("--show-completion", "bash")
    assert done.returncode == 0, done.stderr
    assert "complete" in done.stdout
