"""Helpers for tests that drive a real local cluster over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx2

from kvwire.connectors.directory.directory import KVDirectory


def complete(url: str, prompt, *, max_tokens: int = 12, temperature: float = 0.0, seed=None,
             timeout: float = 120.0, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "return_token_ids": True, **extra}
    resp = httpx2.post(f"{url}/v1/completions", json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete_all(url: str, prompts: list, **kw) -> list[dict]:
    """Send every prompt at once, each on its own thread."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p, **kw), prompts))


def wait_pools_full_and_directory_empty(redis_url: str, timeout_s: float = 15.0,
                                        expect_empty: bool = True) -> tuple[dict, list]:
    """Wait for every live node to report a full pool and no request entries to remain.

    Returns:
        ({node_id: (free, total)}, leftover request ids) as last seen.
    """
    directory = KVDirectory(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            pools = {n.node_id: (n.free_blocks, n.total_blocks) for n in directory.live_nodes()}
            leftover = directory.request_ids()
            full = pools and all(free == total for free, total in pools.values())
            if (full and (not leftover or not expect_empty)) or time.monotonic() > deadline:
                return pools, leftover
            time.sleep(0.25)  # node load is refreshed by heartbeats; nothing to wait on
    finally:
        directory.close()
