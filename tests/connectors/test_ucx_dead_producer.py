"""A producer on this host SIGKILLed while its UCX consumer reads its pool: that pull fails (the request is
recomputed) and the consumer's process lives on.

UCX endpoints between two processes on one host run with error handling off (connectors/transports/ucx/
worker.py). With cross-memory attach among the transports (`UCX_TLS=all`), the consumer's process_vm_readv of
the dead producer is fatal: the consumer process dies of SIGABRT in `cma_ep.c` (7 of 10 trials of this kill,
at 0-30 ms into the pull, before kvwire left `cma` out). The consumer runs in a child for that reason: an
abort shows as its exit code, not as the test run's death.
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
LAYOUT = peer.layout(DType.FLOAT32, 32, 256)  # 200 blocks: a pull of 60-100 ms here, long enough to kill into
BLOCKS = 200
DEADLINE_S = 1.0


def consume(redis_url: str, conn) -> None:
    """Child: a UCX consumer that says "pulling" as it starts the pull, then whether the KV was bypassed."""
    pool = KVPool.allocate(LAYOUT, 2 * BLOCKS, "cpu")
    side = open_consumer(peer.config(ConnectorKind.UCX, NodeRole.DECODE, "consumer-test", redis_url, DEADLINE_S),
                         kv_caches=pool.kv_caches)
    seq = SequenceInput("doomed", [0] * (LAYOUT.block_size * BLOCKS), 0, list(range(BLOCKS, 2 * BLOCKS)))
    conn.send("pulling")
    _, bypass, _ = side.connector.recv_kv_caches_and_hidden_states(None, ModelInput([seq]), pool.kv_caches)
    conn.send(bypass)
    side.close()


@pytest.mark.parametrize("kill_after_s", [0.01, 0.03], ids=["10ms", "30ms"])
def test_consumer_outlives_a_producer_killed_mid_read(redis_url, kill_after_s):
    results = CTX.Queue()
    producer = CTX.Process(target=peer.produce, args=(redis_url, ConnectorKind.UCX, LAYOUT,
                                                      [("doomed", LAYOUT.block_size * BLOCKS, list(range(BLOCKS)))],
                                                      False, 10.0, results), kwargs={"num_blocks": 2 * BLOCKS})
    producer.start()
    parent, child = CTX.Pipe()
    consumer = CTX.Process(target=consume, args=(redis_url, child))
    try:
        assert results.get(timeout=60) == ("published", 1)
        consumer.start()
        assert parent.poll(60) and parent.recv() == "pulling"
        assert not parent.poll(kill_after_s), "the pull ended before the kill: nothing was killed mid-read"
        os.kill(producer.pid, signal.SIGKILL)
        consumer.join(DEADLINE_S + 20)
        assert consumer.exitcode == 0, f"the consumer died with its producer (exit {consumer.exitcode}; -6: SIGABRT)"
        assert parent.recv() is False, "the pull of a dead producer's KV failed: recomputed"
    finally:
        for proc in (consumer, producer):
            if proc.is_alive():
                proc.kill()
            proc.join(5)
