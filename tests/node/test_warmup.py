"""A node is warm before anyone can pick it: real node processes whose warm-up the test holds open.

The node runs in a process of its own (forked from the tests' fork server) exactly as `kvwire prefill|decode`
runs it (`run_node`), except that its warm-up first says it has begun and then waits for the test's word. While
it waits the node is not in the directory, its /readyz is 503 and a router's /readyz cannot disaggregate with
it; once it ends the node registers, its /readyz tells the warm-up, its metrics count no request and no forward,
every block is free, and it published nothing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx2
import pytest
from fastapi.testclient import TestClient

from kvwire.cluster.ports import free_port
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.observability.metrics import Metrics
from kvwire.router.app import create_app
from kvwire.router.config import RouterConfig
from tests.connectors.directory.test_directory import node
from tests.procs import CTX

NUM_BLOCKS = 64
WAIT_S = 60.0  # start-up of a node process (model, self-test) on a busy 2-core machine, with room to spare


def _gated_node(role: str, model_dir: str, redis_url: str, http_port: int, warming, release,
                frozen_when_registered) -> None:
    """In the child: the node `kvwire <role>` would run, its warm-up held until `release` is set; whether it was
    in the directory when it froze its start-up heap goes to `frozen_when_registered` (1: it was, 0: not)."""
    import kvwire.node.runtime as runtime
    from kvwire.cli.options import node_config

    real, real_freeze = runtime.warm_up, runtime.freeze_startup_heap

    def held_warm_up(*args, **kwargs):
        warming.set()
        release.wait(WAIT_S)
        return real(*args, **kwargs)

    def seen_freeze() -> None:
        directory = KVDirectory(redis_url)
        try:
            frozen_when_registered.value = int(directory.get_node(f"{role}-w") is not None)
        finally:
            directory.close()
        real_freeze()

    runtime.warm_up, runtime.freeze_startup_heap = held_warm_up, seen_freeze
    config = node_config(NodeRole(role), model=Path(model_dir), redis_url=redis_url, host="127.0.0.1", port=0,
                         node_id=f"{role}-w", connector=ConnectorKind.TCP, block_size=16, num_blocks=NUM_BLOCKS,
                         kv_deadline=5.0, max_model_len=0, device="cpu", torch_threads=1, http_port=http_port)
    if role == "prefill":
        from kvwire.prefill_node.server import PrefillNode as Node
    else:
        from kvwire.decode_node.server import DecodeNode as Node  # type: ignore[assignment]
    runtime.run_node(config, Node)


def _until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what} within {WAIT_S:.0f}s"
        time.sleep(0.05)


def _node_readyz(port: int) -> httpx2.Response:
    return httpx2.get(f"http://127.0.0.1:{port}/readyz", timeout=5)


def _router_readyz(router: TestClient) -> tuple[int, dict]:
    resp = router.get("/readyz")
    return resp.status_code, resp.json()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_registers_only_once_warmed_up(role, tiny_model_dir, redis_url):
    directory = KVDirectory(redis_url, node_ttl_s=2 * WAIT_S)
    other = NodeRole.DECODE if role == "prefill" else NodeRole.PREFILL
    directory.register_node(node(f"{other}-0", other))  # the other half of the cluster, registered already
    warming, release, frozen_when_registered = CTX.Event(), CTX.Event(), CTX.Value("i", -1)
    port = free_port()
    proc = CTX.Process(target=_gated_node, args=(role, str(tiny_model_dir), redis_url, port, warming, release,
                                                 frozen_when_registered))
    with TestClient(create_app(RouterConfig(model_dir=tiny_model_dir, redis_url=redis_url), Metrics())) as router:
        proc.start()
        try:
            _until(lambda: warming.is_set() or not proc.is_alive(), "the node begins its warm-up")
            assert warming.is_set(), f"the node exited before its warm-up: {proc.exitcode}"
            # model loaded, transport self-tested, warm-up under way: nobody may pick the node yet
            assert directory.get_node(f"{role}-w") is None
            assert _node_readyz(port).status_code == 503
            status, body = _router_readyz(router)
            assert body["disaggregate"] is False and status == (200 if role == "prefill" else 503), body
            release.set()
            _until(lambda: directory.get_node(f"{role}-w") is not None, "the node registers")
            # its start-up heap's full collection (tens of ms) came first: a first request does not wait it out
            assert frozen_when_registered.value == 0, "the node froze its heap only after it registered"
            status, body = _router_readyz(router)
            assert (status, body["disaggregate"]) == (200, True), body
            _until(lambda: _node_readyz(port).status_code == 200, "the node's /readyz turns 200")
            assert "warm-up: " in _node_readyz(port).text and "skipped" not in _node_readyz(port).text
            metrics = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            assert "kvwire_prompt_forward_seconds_count 0.0" in metrics  # warm-up is not a prompt computed
            assert f'kvwire_kv_blocks{{state="free"}} {NUM_BLOCKS}.0' in metrics
            assert directory.get_node(f"{role}-w").free_blocks == NUM_BLOCKS
            assert directory.request_ids() == []  # nothing published, nothing pulled
        finally:
            release.set()
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)  # the node drains (nothing held) and exits 0
            proc.join(30)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            directory.close()
    assert proc.exitcode == 0
