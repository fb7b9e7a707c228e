"""`kvwire up` and `kvwire demo` as a user runs them: real child processes, real signals."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import httpx2
import pytest

from kvwire.cluster.ports import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not printed; got {seen}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_then_stops_everything_it_started(tiny_model_dir, sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", "up", "--model", str(tiny_model_dir),
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = _wait_for_line(proc, "kvwire is up", 120)
        assert f"http://127.0.0.1:{port}" in line
        children = _children(proc.pid)
        assert len(children) == 4  # redis-server, prefill, decode, router
        resp = httpx2.post(f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": "hi", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert resp.status_code == 200 and resp.json()["kvwire"]["bypassed"] is True
        proc.send_signal(sig)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if _alive(c)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_demo_exits_zero_with_identical_outputs(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "demo", "--model", str(tiny_model_dir),
                           "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all 8 outputs identical to the single-process run" in done.stdout
    table = [line for line in done.stdout.splitlines() if line[:2].strip().isdigit()]
    assert len(table) == 8 and all(line.rstrip().endswith("yes") for line in table)
    # it waited until the router could disaggregate: the very first request was prefilled, not recomputed
    ttft = re.search(r"first request ([\d.]+) ms \((\S+)\), tenth ([\d.]+) ms \((\S+)\)", done.stdout)
    assert ttft is not None, done.stdout
    assert (ttft[2], ttft[4]) == ("disaggregated", "disaggregated") and float(ttft[1]) > 0 < float(ttft[3])


def test_up_whose_nodes_cannot_start_says_so_in_one_line(tiny_model_dir):
    """Nodes that exit during start-up (UCX told to use a transport that does not exist: both fail their transport
    self-test) end `kvwire up` with exit 1 and one line naming them, after their own errors: no traceback of its own."""
    env = {**os.environ, "UCX_TLS": "no-such-transport"}
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "up", "--model", str(tiny_model_dir),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvwire up: processes exited during start-up:"), done.stderr
    assert "self-test (auto) failed" in done.stderr  # a node's own error, above
    assert "kvwire/cli/up_cmd.py" not in done.stderr and "local_cluster.py" not in done.stderr
