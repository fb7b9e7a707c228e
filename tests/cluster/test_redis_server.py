"""LocalRedis: a real redis-server started, crashed, restarted and cleaned up."""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import kvwire.cluster.redis_server as redis_server_module
from kvwire.cluster.redis_server import LocalRedis, LocalRedisError

REPO = Path(__file__).resolve().parents[2]
NO_RETRY = Retry(NoBackoff(), 0)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Block until a process that is not our child exits (a pidfd turns readable), or time out."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable)
    finally:
        os.close(fd)


def ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return client.ping()
    finally:
        client.close()


def test_starts_and_stops_cleanly() -> None:
    with LocalRedis() as server:
        pid, workdir = server.pid, Path(server._dir)
        assert server.running and is_alive(pid) and workdir.is_dir()
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("dir") == {"dir": str(workdir)}
        client.close()
    assert not server.running and server.pid is None
    assert not is_alive(pid)  # reaped: no zombie either
    assert not workdir.exists()
    server.stop()  # idempotent


def test_password_is_required() -> None:
    with LocalRedis(password="p@ss word") as server:
        assert server.url == f"redis://:p%40ss%20word@127.0.0.1:{server.port}/0"
        # AuthenticationError is a ConnectionError, which the default client retries with backoff.
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, retry=NO_RETRY)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        wrong = redis.Redis(host="127.0.0.1", port=server.port, password="nope", retry=NO_RETRY)
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        wrong.close()
        assert ping(server.url)


def test_kill_and_restart_on_the_same_port() -> None:
    with LocalRedis() as server:
        port, old_pid = server.port, server.pid
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        server.kill()
        assert not server.running and not is_alive(old_pid)
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.restart()
        assert server.port == port and server.pid != old_pid
        assert client.get("k") is None  # no persistence
        client.close()


def test_two_servers_get_their_own_ports() -> None:
    with LocalRedis() as a, LocalRedis() as b:
        assert a.port != b.port and ping(a.url) and ping(b.url)


def test_retries_on_a_port_race(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = redis_server_module.free_port
        monkeypatch.setattr(redis_server_module, "free_port", lambda: next(ports, None) or real_free_port())
        with LocalRedis() as server:
            assert server.port != taken and ping(server.url)
        with pytest.raises(LocalRedisError, match="port in use"):
            LocalRedis(port=taken).start()


def test_stop_escalates_to_sigkill() -> None:
    server = LocalRedis(stop_timeout_s=0.3).start()
    pid = server.pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    start = time.monotonic()
    server.stop()
    assert not is_alive(pid) and time.monotonic() - start < 2


def test_missing_binary_is_a_local_redis_error(tmp_path: Path) -> None:
    with pytest.raises(LocalRedisError, match="cannot run"):
        LocalRedis(binary=tmp_path / "absent").start()


def test_start_fails_cleanly_with_a_broken_binary(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: broken build'\nexit 1\n")
    fake.chmod(0o755)
    server = LocalRedis(binary=fake)
    with pytest.raises(LocalRedisError, match="broken build"):
        server.start()
    assert server.pid is None and server._dir is None


@pytest.mark.parametrize(("ending", "cleans_up"), [("os._exit(0)", False),
                                                   ("os.kill(os.getpid(), signal.SIGKILL)", False),
                                                   ("pass", True)],
                         ids=["exit-without-atexit", "sigkill", "atexit"])  # fmt: skip
def test_server_dies_with_its_parent(ending: str, cleans_up: bool) -> None:
    script = textwrap.dedent(f"""
        import os, signal, sys
        from kvwire.cluster.redis_server import LocalRedis
        server = LocalRedis().start()
        print(server.pid, server._dir, flush=True)
        sys.stdin.readline()
        {ending}
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid, workdir = parent.stdout.readline().split()
    try:
        assert is_alive(int(pid))
        parent.stdin.write("\n")
        parent.stdin.flush()
        parent.wait(timeout=10)
        assert wait_exit(int(pid), timeout_s=5), f"redis-server {pid} outlived its parent"
        assert Path(workdir).exists() is not cleans_up  # only atexit gets to remove the dir
    finally:
        parent.kill()
        parent.wait()
        shutil.rmtree(workdir, ignore_errors=True)
