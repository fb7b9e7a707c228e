"""host_identity: equal where memory can be shared, different across network / IPC namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvwire.connectors.transports.host import host_identity

PRINT_IDENTITY = "from kvwire.connectors.transports.host import host_identity; print(host_identity())"


def _identity_in(*unshare_flags: str) -> str:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to create namespaces")
    out = subprocess.run(["unshare", *unshare_flags, sys.executable, "-c", PRINT_IDENTITY], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"unshare {' '.join(unshare_flags)} failed: {out.stderr.strip()[-200:]}")
    return out.stdout.strip()


def test_identity_names_this_process_namespaces():
    ident = host_identity()
    assert f"net:{os.stat('/proc/self/ns/net').st_ino}" in ident
    assert f"ipc:{os.stat('/proc/self/ns/ipc').st_ino}" in ident
    same = subprocess.run([sys.executable, "-c", PRINT_IDENTITY], capture_output=True, text=True, timeout=60)
    assert same.stdout.strip() == ident  # another process in the same namespaces: the same host


def test_another_network_namespace_is_another_host():
    assert _identity_in("--net") != host_identity()


def test_another_ipc_namespace_is_another_host():
    assert _identity_in("--ipc") != host_identity()
