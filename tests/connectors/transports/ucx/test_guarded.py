"""UCX endpoints have error handling on but between two CUDA pools on one host (connectors/transports/ucx/
worker.py), and one to a peer on this host still moves its bytes through shared memory.

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
from kvwire.connectors.transports.ucx.send_engine import _guarded
from kvwire.connectors.transports.ucx.worker import Role, UCXWorker, error_handling
from kvwire.connectors.wire import PullRequest
from tests import procs

CTX = procs.CTX


def test_only_a_named_other_host_is_elsewhere():
    assert not elsewhere("")  # a peer that did not say: as before, ours
    assert not elsewhere(host_identity())
    assert elsewhere(host_identity() + "-other")


def test_endpoints_are_guarded_but_between_two_cuda_pools_on_one_host():
    assert error_handling("", device_pool=False)  # host pools: always
    assert error_handling(host_identity(), device_pool=False)
    assert not error_handling(host_identity(), device_pool=True)  # cuda_ipc between two GPUs of this host
    assert error_handling(host_identity() + "-other", device_pool=True)


def test_a_producer_takes_the_consumers_choice_and_asks_an_older_one_by_host():
    def ask(**kw):
        return PullRequest(request_id="r", transfer_id=1, consumer="c", transport_address=b"a", dst_block_ids=[0],
                           **kw)
    assert _guarded(ask(guarded=True)) and not _guarded(ask(guarded=False, host=host_identity() + "-other"))
    assert not _guarded(ask(host=host_identity())) and _guarded(ask(host=host_identity() + "-other"))


def test_a_guarded_endpoint_on_this_host_shares_memory():
    """UCX leaves shared memory out of a guarded endpoint unless its transports are told to take part
    (UCX_SYSV_ERROR_HANDLING / UCX_POSIX_ERROR_HANDLING): kvwire's contexts tell them."""
    consumer, producer = UCXWorker(Role.CONSUMER), UCXWorker(Role.PRODUCER)
    try:
        for guarded in (True, False):
            other = UCXWorker(Role.CONSUMER)
            try:
                path = other.path_to(producer.address, guarded=guarded)
                assert path.path_class == PathClass.SHARED_MEMORY, (guarded, path)
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
