"""A producer on this host SIGKILLed (or SIGSTOPped) while its UCX consumer reads its pool: that pull fails
(the request is recomputed) and the consumer's process lives on, and closes.

Before the endpoints between two host pools had error handling on (connectors/transports/ucx/worker.py), with
cross-memory attach among the transports (`UCX_TLS=all`) the consumer's process_vm_readv of the dead producer
was fatal: the consumer process died of SIGABRT in `cma_ep.c` (7 of 10 trials of this kill, at 0-30 ms into
the pull, before kvwire left `cma` out). A stopped producer is the other hazard: a message it had begun to
send eagerly, in fragments, would hang the consumer's UCX worker as it is destroyed (ucxx drains every
unexpected message then), which is why a host pool's big messages go by rendezvous. The consumer runs in a
child for both reasons: an abort shows as its exit code, a hang as a child that did not exit.
"""

from __future__ import annotations

import os
import signal

import pytest

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.standalone import open_consumer
from kvwire.connectors.wire import DType
from tests import procs
from tests.connectors import peer

CTX = procs.CTX
# Each a pull of 30-100 ms here (200 MiB; same-host UCX moves 6-7 GB/s on a quiet machine), killed into 5 or 15 ms
# after it began: 200 blocks of 1 MiB (a message each), or 1,600 of 128 KiB (packed, 8 a message: more packs come
# than the consumer has slots posted for, packing.py). At 30 ms a quiet machine's pull had sometimes ended.
SHAPES = {"blocks": (peer.layout(DType.FLOAT32, 32, 256), 200), "packed": (peer.layout(DType.FLOAT32, 32, 32), 1600)}
CASES = [("blocks", signal.SIGKILL, 0.005), ("blocks", signal.SIGKILL, 0.015), ("blocks", signal.SIGSTOP, 0.005),
         ("packed", signal.SIGKILL, 0.005), ("packed", signal.SIGSTOP, 0.015)]
DEADLINE_S = 1.0


def consume(redis_url: str, shape: str, conn) -> None:
    """Child: a UCX consumer that says "pulling" as it starts the pull, then whether the KV was bypassed."""
    LAYOUT, BLOCKS = SHAPES[shape]
    pool = KVPool.allocate(LAYOUT, 2 * BLOCKS, "cpu")
    side = open_consumer(peer.config(ConnectorKind.UCX, NodeRole.DECODE, "consumer-test", redis_url, DEADLINE_S),
                         kv_caches=pool.kv_caches)
    seq = SequenceInput("doomed", [0] * (LAYOUT.block_size * BLOCKS), 0, list(range(BLOCKS, 2 * BLOCKS)))
    conn.send("pulling")
    _, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, ModelInput([seq]), pool.kv_caches)
    conn.send(bypass)
    side.close()


@pytest.mark.parametrize(("shape", "sig", "kill_after_s"), CASES,
                         ids=[f"{shape}-{sig.name}-{int(s * 1000)}ms" for shape, sig, s in CASES])
def test_consumer_outlives_a_producer_killed_mid_read(redis_url, kill_after_s, sig, shape):
    LAYOUT, BLOCKS = SHAPES[shape]
    results = CTX.Queue()
    producer = CTX.Process(target=peer.produce, args=(redis_url, ConnectorKind.UCX, LAYOUT,
                                                      [("doomed", LAYOUT.block_size * BLOCKS, list(range(BLOCKS)))],
                                                      False, 10.0, results), kwargs={"num_blocks": 2 * BLOCKS})
    producer.start()
    parent, child = CTX.Pipe()
    consumer = CTX.Process(target=consume, args=(redis_url, shape, child))
    try:
        assert results.get(timeout=60) == ("published", 1)
        consumer.start()
        assert parent.poll(60) and parent.recv() == "pulling"
        assert not parent.poll(kill_after_s), "the pull ended before the kill: nothing was killed mid-read"
        os.kill(producer.pid, sig)
        consumer.join(DEADLINE_S + 20)
        assert consumer.exitcode is not None, "the consumer did not close while its producer was stopped"
        assert consumer.exitcode == 0, f"the consumer died with its producer (exit {consumer.exitcode}; -6: SIGABRT)"
        assert parent.recv() is False, "the pull of a dead producer's KV failed: recomputed"
    finally:
        for proc in (consumer, producer):
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def _send_forever(addresses, peers) -> None:
    """Child: a producer sending 64 messages of 8 MiB to the consumer it is given, progressing until stopped."""
    from kvwire.connectors.transports.ucx.flows import SendFlow
    from kvwire.connectors.transports.ucx.packing import Staging
    from kvwire.connectors.transports.ucx.worker import Role, UCXWorker

    worker = UCXWorker(Role.PRODUCER)
    addresses.put(worker.address)
    flow = SendFlow(worker, peers.get(), [memoryview(bytearray(8 << 20)) for _ in range(64)], 5, 0, Staging(4))
    while True:
        worker.progress()
        flow.advance()


def _receive_some_then_close(addresses, peers, conn) -> None:
    """Child: a consumer that posts receives for 4 of the 64 messages (the rest arrive unposted), is told its
    producer stopped, abandons the pull and destroys its worker."""
    import time

    from kvwire.connectors.transports.ucx.flows import ReceiveFlow
    from kvwire.connectors.transports.ucx.packing import Staging
    from kvwire.connectors.transports.ucx.worker import Role, UCXWorker

    worker = UCXWorker(Role.CONSUMER)
    producer = addresses.get()
    flow = ReceiveFlow(worker, producer, [memoryview(bytearray(8 << 20)) for _ in range(4)], 5, 0, Staging(4))
    peers.put(worker.address)
    start = time.monotonic()
    while time.monotonic() - start < 0.3:
        worker.progress()
        flow.advance()
    conn.send("stop it")
    conn.recv()
    for _ in range(100):
        worker.progress()
    worker.abandon(producer)
    worker.close()
    del flow, worker  # ucxx drains every unexpected message as the worker goes
    conn.send("closed")


def test_a_consumer_worker_closes_while_its_producer_is_stopped_mid_message():
    """A stopped producer's half-sent message must not hold a consumer's worker forever as it is destroyed: a
    host pool's big messages go by rendezvous, never eager in fragments (worker.py)."""
    addresses, peers = CTX.Queue(), CTX.Queue()
    parent, child = CTX.Pipe()
    producer = CTX.Process(target=_send_forever, args=(addresses, peers))
    consumer = CTX.Process(target=_receive_some_then_close, args=(addresses, peers, child))
    producer.start()
    consumer.start()
    try:
        assert parent.poll(60) and parent.recv() == "stop it"
        os.kill(producer.pid, signal.SIGSTOP)
        parent.send("stopped")
        assert parent.poll(20), "the consumer's worker did not go while its producer was stopped"
        assert parent.recv() == "closed"
    finally:
        for proc in (consumer, producer):
            proc.kill()
            proc.join(5)
