"""UCX endpoints to a peer on another host have error handling on (connectors/transports/ucx/worker.py).

Without it a refused or broken TCP connection aborts the whole process inside UCX (openucx/ucx#11629);
with it the one transfer fails and the process goes on.
"""

from __future__ import annotations

import time

import pytest

from kvwire.connectors.transports.data_path import PathClass
from kvwire.connectors.transports.host import elsewhere, host_identity
from kvwire.connectors.transports.ucx.flows import ReceiveFlow, SendFlow
from kvwire.connectors.transports.ucx.packing import Staging
from kvwire.connectors.transports.ucx.worker import Role, UCXWorker
from tests import procs

CTX = procs.CTX


def test_only_a_named_other_host_is_elsewhere():
    assert not elsewhere("")  # a peer that did not say: as before, ours
    assert not elsewhere(host_identity())
    assert elsewhere(host_identity() + "-other")


def test_a_guarded_endpoint_takes_tcp_where_an_unguarded_one_shares_memory():
    consumer, producer = UCXWorker(Role.CONSUMER), UCXWorker(Role.PRODUCER)
    try:
        assert consumer.path_to(producer.address).path_class == PathClass.SHARED_MEMORY
        other = UCXWorker(Role.CONSUMER)
        try:
            assert other.path_to(producer.address, guarded=True).label == "tcp"
        finally:
            other.close()
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("pack_below", [0, 1 << 16])
def test_a_guarded_transfer_is_byte_exact(pack_below):
    producer, consumer = UCXWorker(Role.PRODUCER), UCXWorker(Role.CONSUMER)
    src = [memoryview(bytearray(bytes([i]) * n)) for i, n in enumerate([8, 4096, 300_000])]
    dst = [memoryview(bytearray(len(s))) for s in src]
    try:
        recv = ReceiveFlow(consumer, producer.address, dst, 7, pack_below, Staging(4), guarded=True)
        send = SendFlow(producer, consumer.address, src, 7, pack_below, Staging(4), guarded=True)
        deadline = time.monotonic() + 20
        while not (recv.done() and send.done()):
            assert time.monotonic() < deadline, "guarded transfer did not finish"
            producer.progress()
            recv.advance()
            send.advance()
        recv.check_errors()
        send.check_errors()
        assert [bytes(d) for d in dst] == [bytes(s) for s in src]
    finally:
        producer.close()
        consumer.close()


def _address_then_exit(out) -> None:
    out.put(UCXWorker(Role.CONSUMER).address)


def test_sending_to_a_gone_peer_raises_and_the_process_goes_on():
    """The peer's process has exited: its TCP port refuses. Guarded, making the endpoint or the send raises."""
    queue = CTX.Queue()
    proc = CTX.Process(target=_address_then_exit, args=(queue,))
    proc.start()
    gone = queue.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    producer = UCXWorker(Role.PRODUCER)
    try:
        with pytest.raises(Exception):  # noqa: B017 - UCX raises its own error types
            send_until_done(producer, gone, guarded=True)
    finally:
        producer.close()


def send_until_done(producer: UCXWorker, peer: bytes, guarded: bool, timeout_s: float = 30.0) -> None:
    send = SendFlow(producer, peer, [memoryview(bytearray(1 << 20))], 1, 0, Staging(1), guarded=guarded)
    deadline = time.monotonic() + timeout_s
    while not send.done():
        assert time.monotonic() < deadline, "a send to a gone peer neither failed nor finished"
        producer.progress()
        send.advance()
        send.check_errors()
