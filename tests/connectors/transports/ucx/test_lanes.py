"""UCX lanes: a consumer reading one pull with several workers, one thread each (connectors/transports/ucx/lanes.py)."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import open_consumer
from kvwire.connectors.transports.ucx.flows import SendFlow
from kvwire.connectors.transports.ucx.packing import Staging
from kvwire.connectors.transports.ucx.worker import LANES_MAGIC, Role, UCXWorker, pack_lanes, unpack_lanes
from kvwire.connectors.wire import DType
from tests import procs
from tests.connectors import peer

CTX = procs.CTX


def test_one_lane_is_the_bare_worker_address_and_several_round_trip():
    assert pack_lanes([b"worker-a"]) == b"worker-a"
    assert unpack_lanes(b"worker-a") == [b"worker-a"]
    addresses = [b"a" * 70, b"b" * 3, b"c"]
    assert unpack_lanes(pack_lanes(addresses)) == addresses


@pytest.mark.parametrize("bad", [
    LANES_MAGIC,  # no lane at all
    LANES_MAGIC + b"\x00\x00",  # truncated length
    LANES_MAGIC + b"\x00\x00\x00\x09abc",  # length beyond the end
    LANES_MAGIC + b"\x00\x00\x00\x00",  # empty address
    LANES_MAGIC + b"\x00\x00\x00\x01a" * 17,  # more lanes than allowed
])
def test_malformed_lane_addresses_are_refused(bad):
    with pytest.raises(ValueError):
        unpack_lanes(bad)


def test_a_producer_refuses_to_send_to_a_malformed_lane_address():
    sender = UCXWorker(Role.PRODUCER)
    try:
        with pytest.raises(ValueError):
            SendFlow(sender, LANES_MAGIC + b"\x00\x00\x00\x09abc", [memoryview(bytearray(8))], 1, 0, Staging(1))
    finally:
        sender.close()


def test_lane_count_is_checked_in_the_config():
    with pytest.raises(ValueError, match="pull_lanes"):
        ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="d", redis_url="redis://x", pull_lanes=0)


@pytest.mark.parametrize("lanes", [1, 3])
def test_pulls_over_any_number_of_lanes_are_byte_exact(redis_url, lanes):
    """Odd and even piece counts, fewer pieces than lanes, hidden states: every byte lands where it should."""
    lay = peer.layout(DType.BFLOAT16, 4, 2)
    rng = random.Random(lanes)
    counts = [1, 2, 5, 9]
    ids = rng.sample(range(64), 2 * sum(counts))
    src, dst, i = [], [], 0
    for n in counts:
        src.append(ids[i:i + n])
        dst.append(ids[sum(counts) + i:sum(counts) + i + n])
        i += n
    requests = [(f"lanes{lanes}-{k}", 2 * n - 1, s) for k, (n, s) in enumerate(zip(counts, src))]
    results = CTX.Queue()
    proc = CTX.Process(target=peer.produce, args=(redis_url, ConnectorKind.UCX, lay, requests, False, 10.0, results))
    proc.start()
    config = dataclasses.replace(peer.config(ConnectorKind.UCX, NodeRole.DECODE, "consumer-lanes", redis_url, 10.0),
                                 pull_lanes=lanes)
    pool = KVPool.allocate(lay, 64, "cpu")
    side = open_consumer(config, kv_caches=pool.kv_caches)
    try:
        assert results.get(timeout=60) == ("published", len(requests))
        for (rid, tokens, s), d in zip(requests, dst):
            hidden, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(
                None, ModelInput([SequenceInput(rid, [0] * tokens, 0, d)]), pool.kv_caches)
            assert bypass
            assert torch.equal(pool.data[d], peer.request_kv(rid, lay, len(s)))
            assert peer.received_as_sent(hidden, rid, tokens)
        assert results.get(timeout=30) == ("released", {r: s for r, _, s in requests})
    finally:
        side.close()
        proc.join(30)
        proc.kill()


def test_lanes_cancel_what_never_came_and_serve_the_next_transfer():
    """A producer that never sends: stopping cancels every lane's receives (none can land late), the
    threads let go, and the same lanes then receive a real transfer byte for byte."""
    from kvwire.connectors.transports.ucx.lanes import ReceiveLanes

    producer = UCXWorker(Role.PRODUCER)
    lanes = ReceiveLanes(3)
    try:
        dst = torch.zeros(7, 1000, dtype=torch.uint8)
        parts = [memoryview(row.numpy()) for row in dst]
        lanes.post(producer.address, parts, transfer_id=1)
        time.sleep(0.05)
        assert not lanes.done()
        assert lanes.stop(producer.address) == 7
        assert lanes.done()

        for transfer_id, pack_below in ((2, 0), (3, 4096)):  # then packed (every piece smaller than 4096)
            src = torch.randint(0, 255, (7, 1000), dtype=torch.uint8)
            lanes.post(producer.address, parts, transfer_id, pack_below)
            sends = SendFlow(producer, lanes.address, [memoryview(row.numpy()) for row in src], transfer_id,
                             pack_below, Staging(2))
            deadline = time.monotonic() + 10
            while not (lanes.done() and sends.done()):
                assert time.monotonic() < deadline, "transfer did not complete"
                lanes.progress()
                producer.progress()
                sends.advance()
            lanes.check_errors()
            sends.check_errors()
            assert torch.equal(dst, src)
    finally:
        lanes.close()
        producer.close()


def test_importing_the_ucx_puller_first_keeps_ucx_quiet():
    """UCX prints its warnings to stdout (a bench's --json output): the puller's modules must set kvwire's
    UCX environment before anything imports ucxx."""
    import os
    import subprocess
    import sys

    code = ("from kvwire.connectors.transports.ucx.puller import UCXPuller; "
            "from kvwire.connectors.transports.ucx.lanes import ReceiveLanes; "
            "ReceiveLanes(2).close()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # as a fresh shell has it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, env=env)
    assert "WARN" not in out.stdout + out.stderr
