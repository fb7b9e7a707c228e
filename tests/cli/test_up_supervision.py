"""`kvwire up` keeps serving through a crash, as a user sees it: 16 requests in flight, the prefill node
SIGKILLed; then the decode node; then the router; then Redis. Ctrl-C afterwards leaves nothing behind."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

from kvwire.cluster.ports import free_port
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.cli.test_up_and_demo import _alive, _children, _wait_for_line

pytestmark = pytest.mark.slow

PROMPTS = [[(7 * j + i) % 250 + 1 for j in range(8 + (900 - 8) * i // 15)] for i in range(16)]  # 8..900 tokens
MAX_TOKENS = 8


def _role_pid(up: subprocess.Popen, role: str) -> int | None:
    """The pid of up's child running `kvwire ROLE` (or redis-server, for "redis")."""
    for pid in _children(up.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if role == "redis" and b"redis-server" in args[0]:  # it rewrites its title: ".../redis-server HOST:PORT"
            return pid
        if b"kvwire.cli.main" in args and args[args.index(b"kvwire.cli.main") + 1].decode() == role:
            return pid
    return None


def _post(url: str, prompt: list[int]) -> httpx2.Response | None:
    try:
        return httpx2.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                          "return_token_ids": True}, timeout=60)
    except httpx2.HTTPError:
        return None


def _wait(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _healthy(url: str) -> bool:
    try:
        return httpx2.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx2.HTTPError:
        return False


def _in_flight(url: str, prompts, kill) -> list[httpx2.Response | None]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_post, url, p) for p in prompts]
        time.sleep(0.3)
        kill()
        return [f.result() for f in futures]


def test_up_restarts_what_dies_and_loses_no_request(tiny_model_dir):
    expected = generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    port, stderr_lines = free_port(), []
    up = subprocess.Popen([sys.executable, "-m", "kvwire.cli.main", "up", "--model", str(tiny_model_dir),
                           "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    threading.Thread(target=lambda: stderr_lines.extend(up.stderr), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_line(up, "kvwire is up", 120)
        # the prefill node dies with 16 requests in flight: every one completes with the healthy tokens
        prefill = _role_pid(up, "prefill")
        got = _in_flight(url, PROMPTS, lambda: os.kill(prefill, signal.SIGKILL))
        assert [r.status_code if r else None for r in got] == [200] * 16
        assert [r.json()["choices"][0]["token_ids"] for r in got] == expected
        assert _wait(lambda: _role_pid(up, "prefill") not in (None, prefill), 10)
        after = lambda: (r := _post(url, PROMPTS[3])) is not None and r.json()["kvwire"]["bypassed"]  # noqa: E731
        assert _wait(after, 30), "the restarted prefill node is not used again"
        # the decode node dies: its requests fail with a retryable 503, and succeed when retried
        decode = _role_pid(up, "decode")
        got = _in_flight(url, PROMPTS[:6], lambda: os.kill(decode, signal.SIGKILL))
        failed = [i for i, r in enumerate(got) if r is None or r.status_code != 200]
        assert all(got[i] is not None and got[i].status_code == 503 for i in failed), [r and r.text for r in got]
        assert _wait(lambda: _role_pid(up, "decode") not in (None, decode), 10)
        retried = [_wait(lambda i=i: (r := _post(url, PROMPTS[i])) is not None and r.status_code == 200
                         and r.json()["choices"][0]["token_ids"] == expected[i], 60) for i in failed]
        assert all(retried)
        # the restarted decode node serves before the router dies: when none of the six was in flight at the
        # kill, nothing above waited for it, and a router back within a second would find only the dead
        # incarnation's registration (live until its TTL) and answer a retryable 503
        assert _wait(lambda: (r := _post(url, PROMPTS[2])) is not None and r.status_code == 200, 60)
        # the router dies: another comes back on the same port
        router = _role_pid(up, "router")
        os.kill(router, signal.SIGKILL)
        assert _wait(lambda: _role_pid(up, "router") not in (None, router) and _healthy(url), 60)
        answer = _post(url, PROMPTS[0])
        assert answer is not None and answer.status_code == 200, answer and answer.text
        assert answer.json()["choices"][0]["token_ids"] == expected[0]
        # Redis dies: an empty one comes back on its port, the nodes re-register, requests are served
        redis_pid = _role_pid(up, "redis")
        os.kill(redis_pid, signal.SIGKILL)
        served = lambda: (r := _post(url, PROMPTS[1])) is not None and r.status_code == 200 \
            and r.json()["choices"][0]["token_ids"] == expected[1]  # noqa: E731
        # (a request may even be served before the new server is up: a direct KVReady needs no directory)
        assert _wait(lambda: _role_pid(up, "redis") not in (None, redis_pid), 30) and _wait(served, 30)
        children = _children(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
    assert _wait(lambda: not [c for c in children if _alive(c)], 10)
    text = "".join(stderr_lines)
    for role, pid in (("prefill", prefill), ("decode", decode), ("router", router)):
        assert f"{role} (pid {pid}) died (killed by SIGKILL); restarting it in 0.5s" in text, text
    assert "redis-server died; restarted it, empty, on port" in text, text
    sockets = Path(f"/tmp/kvwire-{os.getuid()}")
    left = [p.name for p in sockets.glob("prefill-0.*.sock")] if sockets.is_dir() else []
    assert not [name for name in left if int(name.split(".")[2]) in children | {prefill}], left
