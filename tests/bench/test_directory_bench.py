"""`kvwire bench directory` at a small size: real redis-server, every step verified."""

from __future__ import annotations

import json
import subprocess
import sys

from kvwire.bench.directory import bench_directory


def test_bench_counts_verified_operations(redis_url):
    result = bench_directory(redis_url, requests=600, batch=100)
    assert result.verified and result.requests == 600
    assert abs(result.ops_per_s - 4 * result.requests_per_s) <= 4  # four steps per request
    assert 0 < result.roundtrip_p50_ms <= result.roundtrip_p99_ms
    assert 0 < result.ping_p50_ms <= result.ping_p99_ms and result.ping_p50_ms < result.roundtrip_p50_ms
    assert result.ping_p50_ms < result.three_pings_p50_ms <= result.three_pings_p99_ms


def test_cli_prints_json():
    done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "directory", "--requests", "300",
                           "--batch", "50", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["verified"] and out["requests"] == 300 and out["ops_per_s"] > 0


def test_node_listing_lists_every_node_in_two_commands(redis_url):
    from kvwire.bench.node_listing import bench_node_listing

    result = bench_node_listing(redis_url, nodes=50, entries=300, routers=10, listings=20)
    assert result.verified and result.redis_commands_per_listing == 2  # ZRANGE + MGET, however many entries
    assert result.redis_commands_per_s == 2 * 10 * 4  # ten routers listing every quarter second
    import redis

    assert redis.Redis.from_url(redis_url).keys("*") == []  # its made-up nodes and entries are gone


def test_cli_refuses_options_of_the_other_mode():
    for args in (["--nodes", "10", "--requests", "5"], ["--routers", "3"]):
        done = subprocess.run([sys.executable, "-m", "kvwire.cli.main", "bench", "directory", *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Invalid value" in done.stderr, (args, done.stderr[-500:])
