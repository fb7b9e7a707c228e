"""Graceful drain: SIGTERM to a node with requests in flight loses none of them.

Real processes: a private Redis, one prefill node, two decode nodes (decode-0 from
LocalCluster, decode-1 spawned here) and the router, KV over TCP.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import time

import httpx2
import msgspec
import pytest
import zmq

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.cluster.ports import free_port
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.engine.reference import generate
from kvwire.protocol.work import DecodeWork, SamplingParams, TokenChunk, WorkError
from tests.integration.cluster import complete, wait_pools_full_and_directory_empty
from tests.procs import FORK

pytestmark = pytest.mark.slow
BS = 16
NUM_BLOCKS = 512
DRAIN_TIMEOUT_S = 30.0  # NodeConfig's default; the CLI does not set it yet
MAX_TOKENS = 160
PROMPTS = [list(range(10 + i, 30 + 5 * i)) for i in range(16)]
LONG_PROMPTS = [[(7 * j + i) % 256 for j in range(1000)] for i in range(6)]  # slow enough to prefill to catch
LONG_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.TCP, block_size=BS, num_blocks=NUM_BLOCKS,
                       log_dir=tmp_path_factory.mktemp("drain-logs"), launch=FORK)
    with LocalCluster(spec) as c:
        args = c._node_args("decode")
        args[args.index("--node-id") + 1] = "decode-1"
        args[args.index("--http-port") + 1] = str(free_port())
        # a smaller pool: the router (most free blocks first) then sends the first burst to decode-0
        args[args.index("--num-blocks") + 1] = str(NUM_BLOCKS - 128)
        c.spawn("decode-1", args)
        _wait_for(lambda: "decode-1" in _node_ids(c.redis_url), 120.0, "decode-1 to register")
        yield c


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    return generate(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), block_size=BS,
                    num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def expected_long(tiny_model_dir):
    return generate(tiny_model_dir, LONG_PROMPTS, SamplingParams(max_tokens=LONG_MAX_TOKENS), block_size=BS,
                    num_blocks=NUM_BLOCKS)


def _wait_for(cond, timeout_s: float, what: str, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every_s)  # other processes' state, nothing to block on
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _node_ids(redis_url: str) -> set[str]:
    directory = KVDirectory(redis_url)
    try:
        return {n.node_id for n in directory.live_nodes(include_draining=True)}
    finally:
        directory.close()


def _draining(redis_url: str, node_id: str) -> bool:
    directory = KVDirectory(redis_url)
    try:
        info = directory.get_node(node_id)
        return info is not None and info.draining and node_id not in {n.node_id for n in directory.live_nodes()}
    finally:
        directory.close()


def _queued(ops_url: str, *queues: str) -> float:
    """The sum of the node's kvwire_queue_depth gauges for `queues`, read from its /metrics."""
    text = httpx2.get(f"{ops_url}/metrics", timeout=2.0).text
    total = 0.0
    for q in queues:
        match = re.search(rf'^kvwire_queue_depth{{queue="{q}"}} (\S+)$', text, re.M)
        total += float(match.group(1)) if match else 0.0
    return total


def _watch_until_gone(redis_url: str, node_id: str, proc, timeout_s: float) -> list[str]:
    """Poll the node's registration until it is gone and the process has exited; the states seen, in order."""
    directory = KVDirectory(redis_url)
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            info = directory.get_node(node_id)
            state = "gone" if info is None else "draining" if info.draining else "live"
            if not seen or seen[-1] != state:
                seen.append(state)
            if state == "gone" and proc.poll() is not None:
                break
            time.sleep(0.02)
    finally:
        directory.close()
    return seen


def _send_directly(work_endpoint: str, work: DecodeWork, reply: zmq.Socket) -> list:
    """Push work to a node's work socket ourselves and collect its answers until the last one."""
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(work_endpoint)
    push.send(pack(work))
    push.close()
    got = []
    while not got or not (isinstance(got[-1], WorkError) or got[-1].finished):
        assert reply.poll(60_000), f"no answer to {work.request_id}"
        got.append(unpack(reply.recv(), expect=(TokenChunk, WorkError)))
    return got


def test_sigterm_decode_node_mid_flight_loses_no_request(cluster, expected):
    decode0 = cluster.procs["decode"]
    directory = KVDirectory(cluster.redis_url)
    work_endpoint = directory.get_node("decode-0").work_endpoint
    directory.close()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(complete, cluster.url, p, max_tokens=MAX_TOKENS) for p in PROMPTS]
        _wait_for(lambda: _queued(cluster.ops_urls["decode"], "decode_running") >= 2, 60.0, "decode-0 to run requests")
        signalled = time.monotonic()
        decode0.send_signal(signal.SIGTERM)
        # routed before the draining mark landed: the draining node forwards it to decode-1
        late = DecodeWork(request_id="late-0", prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=8),
                          prefill_node="", reply_to="")
        reply = zmq.Context.instance().socket(zmq.PULL)
        reply.setsockopt(zmq.LINGER, 0)
        late = msgspec.structs.replace(late, reply_to=f"tcp://127.0.0.1:{reply.bind_to_random_port('tcp://127.0.0.1')}")
        # the directory marks it draining (and live_nodes, which the router picks from, leaves it out)
        _wait_for(lambda: _draining(cluster.redis_url, "decode-0"), 10.0, "decode-0 to be marked draining")
        assert decode0.poll() is None
        answers = _send_directly(work_endpoint, late, reply)
        reply.close()
        # new requests during the drain go to decode-1
        during = complete(cluster.url, PROMPTS[1], max_tokens=MAX_TOKENS)
        seen = _watch_until_gone(cluster.redis_url, "decode-0", decode0, DRAIN_TIMEOUT_S + 10)
        rc = decode0.wait(10)
        drained_in = time.monotonic() - signalled
        results = [f.result() for f in futures]

    assert rc == 0
    assert drained_in < DRAIN_TIMEOUT_S
    assert seen[-1] == "gone" and "live" not in seen, seen
    assert all(isinstance(a, TokenChunk) for a in answers), answers
    assert answers[-1].stats.decode_node == "decode-1"
    assert [t for a in answers for t in a.token_ids] == expected[0][:8]
    assert during["kvwire"]["decode_node"] == "decode-1"
    assert during["choices"][0]["token_ids"] == expected[1]
    by_node = {"decode-0": 0, "decode-1": 0}
    for want, got in zip(expected, results):
        assert got["choices"][0]["token_ids"] == want
        by_node[got["kvwire"]["decode_node"]] += 1
    assert by_node["decode-0"] >= 2, by_node  # some requests were finished by the draining node
    pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
    assert set(pools) == {"prefill-0", "decode-1"}
    assert all(free == total for free, total in pools.values()), pools
    assert leftover == []


def test_sigterm_prefill_node_mid_flight_loses_no_request(cluster, expected_long):
    prefill = cluster.procs["prefill"]
    prompts, want, n = LONG_PROMPTS, expected_long, LONG_MAX_TOKENS
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, cluster.url, p, max_tokens=n) for p in prompts]
        _wait_for(lambda: _queued(cluster.ops_urls["prefill"], "prefill_pending", "prefill_held") >= 1, 60.0,
                  "prefill-0 to hold prompts")
        signalled = time.monotonic()
        prefill.send_signal(signal.SIGTERM)
        seen = _watch_until_gone(cluster.redis_url, "prefill-0", prefill, DRAIN_TIMEOUT_S + 10)
        rc = prefill.wait(10)
        drained_in = time.monotonic() - signalled
        results = [f.result() for f in futures]
        after = complete(cluster.url, prompts[0], max_tokens=n)  # no prefill node: decode alone

    assert rc == 0
    assert drained_in < DRAIN_TIMEOUT_S
    assert seen[-1] == "gone", seen
    # the draining mark can come and go between two polls when the held KV is pulled at once; then the
    # node's log still shows it drained (marked itself draining) rather than just stopping
    log_text = (cluster.spec.log_dir / "prefill.log").read_text(errors="replace")
    assert "draining" in seen or "prefill-0 draining: finishing held work" in log_text, seen
    for w, got in zip(want, results):
        assert got["choices"][0]["token_ids"] == w
    assert any(got["kvwire"]["bypassed"] for got in results)  # KV computed before or during the drain was pulled
    assert after["choices"][0]["token_ids"] == want[0] and after["kvwire"]["bypassed"] is False
    pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url, expect_empty=False)
    assert not any(n.startswith("prefill") for n in pools), pools
    assert all(free == total for free, total in pools.values()), pools
