"""`kvwire status`'s structs, table and JSON, and reading them from a real directory."""

from __future__ import annotations

import time

import msgspec

from kvwire.cluster.status import ClusterStatus, NodeStatus, TransferStatus, read_status, render, to_json
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from kvwire.connectors.wire import NodeEngine, TransportCheck
from kvwire.observability.labels import TransferFailure
from tests.connectors.directory.test_directory import node


def _status(transfers: bool = True) -> ClusterStatus:
    nodes = [NodeStatus(node_id="decode-0", role=NodeRole.DECODE, address="tcp://127.0.0.1:5001",
                        connector=ConnectorKind.TCP, epoch=3, queue_depth=2, running=5, free_blocks=100,
                        total_blocks=512, heartbeat_age_s=1.25, pulls=7, recomputed={TransferFailure.DEADLINE: 2},
                        prefix_misses=1, model="5be3cded080143ef",
                        transport_checks=[TransportCheck(transport=ConnectorKind.TCP, ok=True, path="tcp", ms=2.0)]),
             NodeStatus(node_id="prefill-0", role=NodeRole.PREFILL, address="tcp://127.0.0.1:5002",
                        connector=ConnectorKind.AUTO, epoch=1, queue_depth=0, running=1, free_blocks=500,
                        total_blocks=512, heartbeat_age_s=None,
                        transport_checks=[TransportCheck(transport=ConnectorKind.SHM, ok=True, path="shm", ms=1.0),
                                          TransportCheck(transport=ConnectorKind.UCX, ok=False, path="unknown",
                                                         ms=9.0, reason="timed out")])]
    xfers = [TransferStatus(request_id="cmpl-1", state=TransferState.READY, producer="prefill-0", age_s=0.5),
             TransferStatus(request_id="cmpl-2", state=TransferState.FAILED, producer="prefill-0", age_s=12.0,
                            reason="prefill failed")]
    return ClusterStatus(directory="redis://127.0.0.1:6379/0", nodes=nodes, transfers=xfers if transfers else [])


def test_table_has_a_row_per_node_and_transfer_in_aligned_columns():
    lines = render(_status()).splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    decode = next(line for line in lines if line.startswith("decode-0"))
    assert header.split() == ["NODE", "ROLE", "ADDRESS", "CONNECTOR", "EPOCH", "QUEUED", "RUNNING", "FREE",
                              "BLOCKS", "HEARTBEAT", "TRANSPORT", "PATH", "PULLS", "RECOMPUTED", "MODEL"]
    assert decode.split() == ["decode-0", "decode", "tcp://127.0.0.1:5001", "tcp", "3", "2", "5", "100/512", "1.2s",
                              "tcp:tcp", "7", "deadline:2", "prefix_miss:1", "5be3cded080143ef"]  # pulls, recomputes
    assert header.index("ROLE") == decode.index(" decode ") + 1 and header.index("HEARTBEAT") == decode.index("1.2s")
    prefill = next(line for line in lines if line.startswith("prefill-0"))
    assert prefill.split()[-6:] == ["-", "shm:shm", "ucx:FAILED", "-", "-", "-"]  # its model not known
    failed = next(line for line in lines if line.startswith("cmpl-2"))
    assert failed.split()[:4] == ["cmpl-2", "failed", "prefill-0", "12.0s"] and failed.endswith("prefill failed")
    assert "nodes (2 live)" in lines and "transfers (2 in the directory)" in lines


def test_empty_sections_say_none():
    text = render(ClusterStatus(directory="redis://x", nodes=[], transfers=[]))
    assert text.count("(none)") == 2


def test_json_round_trips():
    status = _status()
    assert msgspec.json.decode(to_json(status), type=ClusterStatus) == status


def test_read_status_from_the_directory(redis_url):
    directory = KVDirectory(redis_url)
    try:
        now = time.time()
        directory.register_node(msgspec.structs.replace(node("decode-0", NodeRole.DECODE, epoch=2),
                                                        queue_depth=4, running=1, heartbeat_at=now - 1.5))
        directory.register_node(node("prefill-0", NodeRole.PREFILL))  # an older node: no heartbeat time
        directory.create_pending("cmpl-9", "prefill-0")
        status = read_status(directory, now=now)
    finally:
        directory.close()
    decode, prefill = status.nodes
    assert (decode.node_id, decode.role, decode.epoch, decode.queue_depth, decode.running) == (
        "decode-0", NodeRole.DECODE, 2, 4, 1)
    assert abs(decode.heartbeat_age_s - 1.5) < 1e-6 and prefill.heartbeat_age_s is None
    [xfer] = status.transfers
    assert (xfer.request_id, xfer.state, xfer.producer) == ("cmpl-9", TransferState.PENDING, "prefill-0")
    assert 0 <= xfer.age_s < 5


def test_a_vllm_servers_rank_is_listed_with_its_process_and_no_load_it_cannot_know(redis_url):
    directory = KVDirectory(redis_url)
    try:
        directory.register_node(msgspec.structs.replace(
            node("vllm-vm-6d45e7cd", NodeRole.PREFILL), work_endpoint="", engine=NodeEngine.VLLM,
            host="vm/boot-id/net:1/ipc:2", pid=4242, total_blocks=8192, heartbeat_at=time.time()))
        status = read_status(directory)
    finally:
        directory.close()
    [rank] = status.nodes
    assert rank.engine == NodeEngine.VLLM and rank.address == "vllm pid 4242 on vm"
    row = next(line for line in render(status).splitlines() if line.startswith("vllm-vm-6d45e7cd"))
    cells = row.split()
    assert cells[1:7] == ["prefill", "vllm", "pid", "4242", "on", "vm"] and cells[9:12] == ["-", "-", "-/8192"]


def test_a_decode_node_no_prefill_node_shares_a_checkpoint_with_is_called_out():
    status = _status()
    decode, prefill = status.nodes
    other = msgspec.structs.replace(prefill, model="aaaa")  # decode-0's is 5be3cded080143ef
    lines = render(msgspec.structs.replace(status, nodes=[decode, other])).splitlines()
    assert "WARNING: decode-0 serves checkpoint 5be3cded080143ef, no live prefill node does" in "\n".join(lines)
    same = msgspec.structs.replace(prefill, model=decode.model)
    assert "WARNING" not in render(msgspec.structs.replace(status, nodes=[decode, same, other]))
    assert "WARNING" not in render(status)  # a node that does not say its model agrees with any


def test_a_producers_settling_pulls_are_shown_beside_what_it_holds(redis_url):
    """A failed pull whose sends may still read its blocks keeps them held (connectors/producer/transfer_server.py):
    the heartbeat carries the count, and RUNNING shows it, for a kvwire prefill node and a vLLM server's rank."""
    directory = KVDirectory(redis_url)
    try:
        directory.register_node(msgspec.structs.replace(node("prefill-0", NodeRole.PREFILL), running=3, settling=1))
        directory.register_node(msgspec.structs.replace(
            node("vllm-vm-1", NodeRole.PREFILL), work_endpoint="", engine=NodeEngine.VLLM, pid=7, settling=2))
        status = read_status(directory)
    finally:
        directory.close()
    assert sorted((n.node_id, n.settling) for n in status.nodes) == [("prefill-0", 1), ("vllm-vm-1", 2)]
    rows = {line.split()[0]: line for line in render(status).splitlines() if line.startswith(("prefill-0", "vllm-vm"))}
    assert " 3 +1 settling " in rows["prefill-0"] and " - +2 settling " in rows["vllm-vm-1"]
    assert "settling" not in render(_status())  # none settling: the column as before
