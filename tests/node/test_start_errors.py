"""A node that cannot start says why in one line and exits 1: its ops port or its work port held by another
process, an address that is not this host's. Real node processes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _prefill(model_dir, redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvwire.cli.main", "prefill", "--model", str(model_dir),
                           "--redis-url", redis_url, "--no-warmup", "--directory-wait", "5", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("flag", "what"), [("--http-port", "ops endpoint http"), ("--port", "work socket tcp")])
def test_a_port_in_use_is_one_line(tiny_model_dir, redis_url, flag, what):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = _prefill(tiny_model_dir, redis_url, flag, str(port))
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvwire prefill: {what}://127.0.0.1:{port}: Address already in use"
        + (f" (addr='tcp://127.0.0.1:{port}')" if flag == "--port" else ""))
    assert "Traceback" not in done.stderr


def test_an_address_not_of_this_host_is_one_line(tiny_model_dir, redis_url):
    done = _prefill(tiny_model_dir, redis_url, "--host", "192.0.2.1")  # TEST-NET-1: on no interface here
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("kvwire prefill: ")
    assert "192.0.2.1" in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr
