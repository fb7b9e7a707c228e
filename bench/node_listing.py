"""`kvwire bench directory --nodes N`: what listing the live nodes costs Redis and a router, in a fleet.

1. Register `nodes` nodes (half prefill, half decode), as their heartbeats do, and put `entries` READY request
   entries beside them (the keyspace a busy directory holds: a listing that scans it pays for them).
2. List the nodes `listings` times from one client, as a router's placement does (router/placement.py:
   NODES_FRESH_S, every quarter second while requests come), counting between the first and the last what
   Redis processed (INFO commandstats: commands; INFO cpu: its CPU) and what the client's CPU spent.
3. Scale to `routers` routers each listing every NODES_FRESH_S.

Everything it writes is under a namespace of its own (NAMESPACE: no router of a deployment sharing the Redis lists
its made-up nodes) and deleted at the end.
"""

from __future__ import annotations

import statistics
import time
from typing import cast

import msgspec

from kvwire.bench.directory import _location
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.batch import DirectoryBatch
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.wire import NodeInfo
from kvwire.router.placement import NODES_FRESH_S

NAMESPACE = "kvwire-bench-listing"


class NodeListingResult(msgspec.Struct, frozen=True):
    nodes: int
    entries: int
    routers: int
    listings: int
    listing_p50_ms: float  # one live_nodes() call, at the client
    client_cpu_ms_per_listing: float  # the router's CPU for one listing (decode included)
    redis_commands_per_listing: float
    redis_cpu_ms_per_listing: float
    redis_commands_per_s: float  # `routers` routers, each listing every NODES_FRESH_S
    redis_cpu_share: float  # of one core, for those routers
    verified: bool  # every listing returned every node


def _node(i: int) -> NodeInfo:
    role = NodeRole.PREFILL if i % 2 == 0 else NodeRole.DECODE
    return NodeInfo(node_id=f"bench-node-{i:05d}", role=role, epoch=1, connector=ConnectorKind.UCX,
                    work_endpoint=f"tcp://10.0.{i // 250}.{i % 250}:1", free_blocks=1000, total_blocks=1000)


def _redis_counters(d: KVDirectory) -> tuple[int, float]:
    """(commands processed, CPU seconds used) by the Redis server so far."""
    stats = cast(dict, d._redis.info("commandstats"))
    cpu = cast(dict, d._redis.info("cpu"))
    commands = sum(int(v["calls"]) for v in stats.values())
    return commands, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def bench_node_listing(redis_url: str, nodes: int, entries: int, routers: int, listings: int) -> NodeListingResult:
    d = KVDirectory(redis_url, entry_ttl_s=600.0, node_ttl_s=600.0, namespace=NAMESPACE)
    try:
        for first in range(0, nodes, 256):
            for i in range(first, min(first + 256, nodes)):
                d.register_node(_node(i))
        for first in range(0, entries, 256):
            batch = DirectoryBatch(d)
            for i in range(first, min(first + 256, entries)):
                batch.publish_ready(_location(f"bench-entry-{i}"))
            batch.execute()
        verified = len(d.live_nodes(role=None)) == nodes
        times = []
        commands0, redis_cpu0 = _redis_counters(d)
        cpu0 = time.process_time()
        for _ in range(listings):
            start = time.perf_counter()
            listed = d.live_nodes(role=None)
            times.append(time.perf_counter() - start)
            verified &= len(listed) == nodes
        cpu = time.process_time() - cpu0
        commands1, redis_cpu1 = _redis_counters(d)
        per_s = routers / NODES_FRESH_S  # listings per second, all routers together
        commands = (commands1 - commands0 - 2) / listings  # the two INFOs of the first count are not listings'
        redis_cpu = (redis_cpu1 - redis_cpu0) / listings
        return NodeListingResult(nodes=nodes, entries=entries, routers=routers, listings=listings,
                                 listing_p50_ms=round(statistics.median(times) * 1e3, 3),
                                 client_cpu_ms_per_listing=round(cpu / listings * 1e3, 3),
                                 redis_commands_per_listing=round(commands, 2),
                                 redis_cpu_ms_per_listing=round(redis_cpu * 1e3, 3),
                                 redis_commands_per_s=round(commands * per_s, 1),
                                 redis_cpu_share=round(redis_cpu * per_s, 3), verified=verified)
    finally:
        for chunk in _chunks(list(d._redis.scan_iter(match=f"{NAMESPACE}:*", count=1000)), 1000):
            d._redis.delete(*chunk)
        d.close()


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]
