"""A node that starts before its Redis: it waits for it (`--directory-wait`), then registers; past the wait it
exits in one line. Real node processes, a real redis-server started late on the port they were given."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx2
import pytest

from kvwire.cluster.ports import free_port
from kvwire.cluster.redis_server import LocalRedis
from kvwire.connectors.directory.directory import KVDirectory

pytestmark = pytest.mark.slow


def _prefill(model_dir, redis_port: int, wait_s: float, http_port: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", "prefill", "--model", str(model_dir),
                             "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--node-id", "early-prefill",
                             "--directory-wait", str(wait_s), "--http-port", str(http_port), "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_node_started_before_redis_waits_for_it_then_registers(tiny_model_dir):
    redis_port, http_port = free_port(), free_port()
    node, lines = _prefill(tiny_model_dir, redis_port, 60, http_port), []
    threading.Thread(target=lambda: lines.extend(node.stderr), daemon=True).start()
    redis = LocalRedis(port=redis_port)
    try:
        _wait_until(lambda: any("waits up to 60 s" in line for line in lines), 60, f"no wait logged: {lines}")
        assert node.poll() is None
        assert httpx2.get(f"http://127.0.0.1:{http_port}/readyz", timeout=5).status_code == 503
        redis.start()
        directory = KVDirectory(redis.url)
        try:
            _wait_until(lambda: "early-prefill" in {n.node_id for n in directory.live_nodes()}, 30,
                        f"not registered: {lines}")
        finally:
            directory.close()
        _wait_until(lambda: httpx2.get(f"http://127.0.0.1:{http_port}/readyz", timeout=5).status_code == 200, 30,
                    f"not ready: {lines}")
        assert any("answers; node early-prefill goes on" in line for line in lines)
    finally:
        node.terminate()
        node.wait(30)
        redis.stop()


def test_a_node_whose_redis_never_answers_exits_in_one_line(tiny_model_dir):
    node = _prefill(tiny_model_dir, free_port(), 1)
    _, err = node.communicate(timeout=60)
    assert node.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvwire prefill: directory redis://127.0.0.1:") and "not answering after 1 s" in last
    assert "Traceback" not in err
