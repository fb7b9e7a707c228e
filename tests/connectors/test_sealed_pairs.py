"""A producer whose control messages are sealed (what the vLLM connector's `auth_secret_file` installs), between
real processes: a consumer with the same secret pulls as before; one with another secret, or none, fails its first
pull at once saying why (not at its deadline); a pull request forged from outside is refused, counted, and the
producer serves on. Over the side channel (tcp) and the shared-memory hand-off (shm).
"""

from __future__ import annotations

import time

import pytest
import zmq

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.control import auth
from kvwire.connectors.control.framing import unpack
from kvwire.connectors.wire import PullReply, PullRequest, encode
from tests import procs
from tests.connectors.transports.shm.test_planes import Consumer, hold_vllm_kv

CTX = procs.CTX
SECRET, OTHER = b"s" * 32, b"o" * 32
HOLD_S = 6.0  # the producer's: what no sealed pull takes lapses then
DEADLINE_S = 30.0  # the consumer's: a pull that failed only at it would show


def sealed_producer(redis_url: str, kind: ConnectorKind, results, counts) -> None:
    """Child: hold vLLM-layout KV with SECRET installed; then report how many messages it refused."""
    auth.install(SECRET)
    hold_vllm_kv(redis_url, kind, 2, 8, [("good", [1]), ("bad", [2]), ("none", [3])], HOLD_S, results)
    counts.put(auth.rejected_count())


@pytest.fixture
def no_secret_after():
    yield
    auth.install(None)


@pytest.mark.parametrize("kind", [ConnectorKind.TCP, ConnectorKind.SHM])
def test_only_the_same_secret_pulls_and_a_forged_request_is_refused(redis_url, kind, no_secret_after):
    results, counts = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=sealed_producer, args=(redis_url, kind, results, counts))
    proc.start()
    side = None
    try:
        assert results.get(timeout=60)[0] == "held"
        side = Consumer(redis_url, kind, 2, 8, hold_s=DEADLINE_S)
        loc = side.directory.get("good").location
        assert _forged_refusal(loc.side_channel, "good") is not None  # unsealed, from outside: refused, answered
        auth.install(SECRET)
        side.pull("good", [6])
        assert side.holds("good", [6]), "the producer served on, and a sealed pair moves KV as before"
        for secret, rid in ((OTHER, "bad"), (None, "none")):  # each a consumer process of its own would be
            auth.install(secret)
            other = Consumer(redis_url, kind, 2, 8, hold_s=DEADLINE_S)
            start = time.monotonic()
            try:
                with pytest.raises(TransferError, match="secret"):
                    other.pull(rid, [5])
            finally:
                other.close()
            assert time.monotonic() - start < 5, "a pair with different secrets fails at once, not at its deadline"
    finally:
        if side is not None:
            side.close()
        proc.join(HOLD_S + 20)
        proc.kill()
    assert counts.get(timeout=10) >= 3, "the forged request and the two unsealable pulls were counted"


def _forged_refusal(endpoint: str, rid: str) -> PullReply | None:
    """An unsealed pull request for `rid` sent to the producer's side channel from a bare socket: its answer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(PullRequest(request_id=rid, transfer_id=1, consumer="intruder", transport_address=b"x",
                                     dst_block_ids=[0])))
        if not sock.poll(10_000):
            return None
        auth.install(SECRET)  # only to read the refusal: it is sealed
        reply = unpack(sock.recv(), expect=PullReply)
        auth.install(None)
        assert not reply.ok and "unauthenticated" in reply.reason
        return reply
    finally:
        sock.close()
