"""bench/ucx_proto.py: the protocol UCX says it chose, read from logs captured with UCX_PROTO_INFO=y."""

from __future__ import annotations

from kvwire.bench.ucx_proto import chosen, notices, parse_tables

# NIXL READ between two processes on this 2-core host, DRAM (captured with nixl-cu12 1.5.1, trimmed): the
# initiator's worker to itself, an active-message table, then the read that carried the pieces
HOST_READ = """\
[1795793217.293634] [vm:6618 :0]   +--------+-------------+-----------------------------------+
[1795793217.293634] [vm:6618 :0]   | bench-1 self cfg#0                                       |
[1795793217.293634] [vm:6618 :0]   | remote memory write by ucp_put* from host memory to host |
[1795793217.293634] [vm:6618 :0]   +--------+-------------+-----------------------------------+
[1795793217.293634] [vm:6618 :0]   | Range  | Description |              Config               |
[1795793217.293634] [vm:6618 :0]   +--------+-------------+-----------------------------------+
[1795793217.293634] [vm:6618 :0]   | 0..inf | zero-copy   | cma/memory                        |
[1795793217.293634] [vm:6618 :0]   +--------+-------------+-----------------------------------+
[1795793217.299146] [vm:6618 :0]   +-------------+--------------------+---------------------+
[1795793217.299146] [vm:6618 :0]   | bench-1 intra-node cfg#1                               |
[1795793217.299146] [vm:6618 :0]   | active message by ucp_am_send*(multi) from host memory |
[1795793217.299146] [vm:6618 :0]   +-------------+--------------------+---------------------+
[1795793217.299146] [vm:6618 :0]   |    Range    |    Description     |       Config        |
[1795793217.299146] [vm:6618 :0]   +-------------+--------------------+---------------------+
[1795793217.299146] [vm:6618 :0]   |     0..8184 | short              | tcp/lo              |
[1795793217.299146] [vm:6618 :0]   | 8185..65528 | zero-copy          | tcp/lo              |
[1795793217.299146] [vm:6618 :0]   |  65529..inf | multi-frag copy-in | tcp/lo              |
[1795793217.299146] [vm:6618 :0]   +-------------+--------------------+---------------------+
[1795793217.300001] [vm:6618 :0]    ucp_worker.c:2100 UCX  WARN  a warning between two tables
[1795793217.315230] [vm:6618 :0]   +--------+-------------+-------------------------------------------+
[1795793217.315230] [vm:6618 :0]   | bench-1 intra-node cfg#1                                         |
[1795793217.315230] [vm:6618 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795793217.315230] [vm:6618 :0]   +--------+-------------+-------------------------------------------+
[1795793217.315230] [vm:6618 :0]   | Range  | Description |                  Config                   |
[1795793217.315230] [vm:6618 :0]   +--------+-------------+-------------------------------------------+
[1795793217.315230] [vm:6618 :0]   | 0..inf | zero-copy   | cma/memory                                |
[1795793217.315230] [vm:6618 :0]   +--------+-------------+-------------------------------------------+
"""

# the table issue 45 quotes from an H200 (NIXL's bundled UCX, READ into one GPU from the same GPU), and the
# same read as cuda_ipc's get would carry it, split by size as UCX may split it
GPU_EMULATED = """\
[1795800000.100000] [h200:4242 :0]   +--------+--------------------+--------------------------------+
[1795800000.100000] [h200:4242 :0]   | bench-1 intra-node cfg#2                                        |
[1795800000.100000] [h200:4242 :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1795800000.100000] [h200:4242 :0]   +--------+--------------------+--------------------------------+
[1795800000.100000] [h200:4242 :0]   | Range  | Description        | Config                         |
[1795800000.100000] [h200:4242 :0]   +--------+--------------------+--------------------------------+
[1795800000.100000] [h200:4242 :0]   | 0..inf | software emulation | tcp/lo                         |
[1795800000.100000] [h200:4242 :0]   +--------+--------------------+--------------------------------+
"""
GPU_IPC = """\
[1795800000.200000] [h100:77:0]   +------------+-----------+---------------+
[1795800000.200000] [h100:77:0]   | bench-1 intra-node cfg#2                                              |
[1795800000.200000] [h100:77:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1795800000.200000] [h100:77:0]   +------------+-----------+---------------+
[1795800000.200000] [h100:77:0]   |   Range    | Description | Config      |
[1795800000.200000] [h100:77:0]   +------------+-----------+---------------+
[1795800000.200000] [h100:77:0]   |    0..16K  | copy-in   | cuda_copy/cuda |
[1795800000.200000] [h100:77:0]   |  16385..inf | zero-copy | cuda_ipc/cuda |
[1795800000.200000] [h100:77:0]   +------------+-----------+---------------+
"""


def test_tables_are_read_with_their_scope_operation_and_byte_ranges():
    tables = parse_tables(HOST_READ)
    assert [(t.scope, t.to_self) for t in tables] == [("bench-1 self cfg#0", True), ("bench-1 intra-node cfg#1", False),
                                                     ("bench-1 intra-node cfg#1", False)]
    assert tables[1].operation == "active message by ucp_am_send*(multi) from host memory"
    assert [(r.lo, r.hi, r.description, r.config) for r in tables[1].rows] == [
        (0, 8184, "short", "tcp/lo"), (8185, 65528, "zero-copy", "tcp/lo"),
        (65529, float("inf"), "multi-frag copy-in", "tcp/lo")]
    assert [(r.lo, r.hi) for r in parse_tables(GPU_IPC)[0].rows] == [(0, 16384), (16385, float("inf"))]


def test_the_initiators_read_names_the_transport_that_carried_the_pieces():
    assert chosen(HOST_READ, "remote memory read", (32768, 32768)) == \
        "remote memory read by ucp_get*(multi) into host memory from host: zero-copy cma/memory"
    assert chosen(HOST_READ, "remote memory write", (32768, 32768)) is None  # only the worker's loopback wrote
    assert chosen(GPU_EMULATED, "remote memory read", (32768, 32768)) == \
        "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]: software emulation tcp/lo"


def test_only_the_rows_covering_the_pieces_sizes_are_named():
    op = "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]"
    assert chosen(GPU_IPC, "remote memory read", (32768, 2 * 2**20)) == f"{op}: zero-copy cuda_ipc/cuda"
    assert chosen(GPU_IPC, "remote memory read", (4096, 32768)) == \
        f"{op}: [0..16384] copy-in cuda_copy/cuda; [16385..inf] zero-copy cuda_ipc/cuda"
    both = chosen(HOST_READ + GPU_EMULATED, "remote memory read", (32768, 32768))
    assert both is not None and " | " in both and both.endswith("software emulation tcp/lo")


def test_warnings_in_the_log_are_passed_on_and_a_log_without_tables_names_nothing():
    assert notices(HOST_READ) == ["ucp_worker.c:2100 UCX  WARN  a warning between two tables"]
    assert parse_tables("") == [] and chosen("not a UCX log\n| x |\n", "remote memory read", (1, 1)) is None
