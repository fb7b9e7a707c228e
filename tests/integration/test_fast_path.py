"""No silent slow path: two nodes on one host whose UCX is forced onto tcp (UCX_TLS=tcp), as real processes.

Both nodes' start-up self-test reports "tcp" (in /readyz, `kvwire status` and
kvwire_transport_info); the decode node warns once about its same-host producer, and
with --require-fast-path refuses its KV instead: every prompt is recomputed there, with
the reason in its metrics, and the outputs still equal the single-process run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from kvwire.cluster.ports import free_port
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.faults.harness import pool, wait_until
from tests.integration.cluster import complete
from tests.integration.test_observability import one, scrape

pytestmark = pytest.mark.slow
PROMPTS = [list(range(40)), [ord(c) for c in "same host, slow path"], [7, 8, 9]]
WARNING = "expected sysv/posix/cma (UCX shared memory), actual tcp (over ucx)"


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 90.0) -> httpx2.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a process exited during start-up"
        try:
            resp = httpx2.get(f"{url}/readyz", timeout=2)
            if resp.status_code == 200:
                return resp
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)  # start-up: nothing to wait on but the processes' HTTP endpoints
    raise AssertionError(f"{url} not ready within {timeout_s:.0f}s")


@pytest.fixture(params=[False, True], ids=["warn", "require-fast-path"])
def cluster(request, tiny_model_dir, redis_url, tmp_path):
    """(router URL, {role: ops URL}, decode log, require_fast_path): UCX on tcp only, every process on this host."""
    require = request.param
    env = {**os.environ, "UCX_TLS": "tcp"}
    ops = {role: f"http://127.0.0.1:{free_port()}" for role in ("prefill", "decode")}
    router_port = free_port()
    common = ["--model", str(tiny_model_dir), "--redis-url", redis_url, "--connector", "ucx", "--num-blocks", "128",
              "--kv-deadline", "10"]
    procs = []
    try:
        for role in ("prefill", "decode"):
            extra = ["--require-fast-path"] if role == "decode" and require else []
            procs.append(_spawn([role, *common, "--node-id", f"{role}-0", "--http-port", ops[role].rsplit(":", 1)[1],
                                 *extra], tmp_path / f"{role}.log", env))
        procs.append(_spawn(["router", "--model", str(tiny_model_dir), "--redis-url", redis_url, "--port",
                             str(router_port)], tmp_path / "router.log", env))
        router = f"http://127.0.0.1:{router_port}"
        for url in (*ops.values(), router):
            _wait_ready(url, procs)
        yield router, ops, tmp_path / "decode.log", require
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_ucx_on_tcp_between_same_host_nodes_is_reported_and_warned_or_refused(cluster, tiny_model_dir, redis_url):
    router, ops, decode_log, require = cluster
    for role, url in ops.items():
        lines = httpx2.get(f"{url}/readyz", timeout=5).text.splitlines()  # ready, the self-test, the warm-up
        assert lines[0] == "ready" and lines[1].startswith("transport ucx: ok in ") and \
            lines[1].endswith(" ms over tcp") and lines[2].startswith("warm-up: "), (role, lines)
        assert one(scrape(url), "kvwire_transport_info", transport="ucx", path="tcp", self_test="ok") == 1
    status = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "status", "--redis-url", redis_url],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    rows = [line for line in status.stdout.splitlines() if line.startswith(("prefill-0", "decode-0"))]
    assert len(rows) == 2 and all("ucx:tcp" in row.split() for row in rows), status.stdout  # TRANSPORT PATH

    expected = generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    for prompt, want in zip(PROMPTS, expected):  # one after another: each pull meets the warned-about peer
        got = complete(router, prompt, max_tokens=6)
        assert got["choices"][0]["token_ids"] == want
        assert got["kvwire"]["bypassed"] is not require

    decode = scrape(ops["decode"])
    refused = one(decode, "kvwire_kv_transfers_failed_total", reason="slow_path")
    recomputed = one(decode, "kvwire_recomputes_total", reason="kv_not_received")
    assert (refused, recomputed) == ((len(PROMPTS), len(PROMPTS)) if require else (0, 0))
    # the refused KV is released at once (the decode node abandons its pull), not at the 10 s hold deadline
    assert wait_until(lambda: (p := pool(ops["prefill"])) is not None and p[0] == p[1], 3.0, 0.05), pool(ops["prefill"])
    log = decode_log.read_text()
    warned = [line for line in log.splitlines() if "kvwire.connectors.consumer.fast_path" in line]
    assert len(warned) == 1 and WARNING in warned[0], log[-3000:]  # once per producer, however many pulls
    assert ("refusing its KV (--require-fast-path)" in warned[0]) is require
