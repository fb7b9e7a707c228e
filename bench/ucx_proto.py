"""What UCX says it chose: the protocol tables `UCX_PROTO_INFO=y` prints, read back from its log.

UCX prints one table the first time a worker selects protocols for an operation, memory types and
peer, in its log (`UCX_LOG_FILE`; stdout by default), each line after a `[time] [host:pid:tid]`
prefix:

    +--------+-------------+-----------------------------------+
    | bench-1 intra-node cfg#1                                   |
    | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
    +--------+-------------+-----------------------------------+
    | Range  | Description | Config                            |
    +--------+-------------+-----------------------------------+
    | 0..inf | software emulation | tcp/lo                     |
    +--------+-------------+-----------------------------------+

So the tables of an initiator's log name the transport its transfers took ("zero-copy cuda_ipc/cuda",
"software emulation tcp/lo"): NIXL's API names only the backend (UCX), not the protocol.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_PREFIX = re.compile(r"^\[[\d.]+\] \[[^\]]*\]\s*")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^(\d+)([KMGT]?)B?$")


class ProtoRow(NamedTuple):
    lo: float  # bytes, inclusive
    hi: float  # bytes, inclusive; inf
    description: str  # "zero-copy", "software emulation", "multi-frag copy-in", ...
    config: str  # the lane(s): "cma/memory", "cuda_ipc/cuda", "tcp/lo", ...


class ProtoTable(NamedTuple):
    scope: str  # "<worker> intra-node cfg#1"; "self" where a worker talks to itself
    operation: str  # "remote memory read by ucp_get*(multi) into host memory from host"
    rows: tuple[ProtoRow, ...]

    @property
    def to_self(self) -> bool:
        return " self " in f" {self.scope} "


def parse_tables(log: str) -> list[ProtoTable]:
    """Every complete protocol table in a UCX log, in order; other lines (warnings) are skipped."""
    tables: list[ProtoTable] = []
    titles: list[str] = []
    rows: list[ProtoRow] | None = None  # None until the table's `Range | Description | Config` header
    for line in log.splitlines():
        text = _PREFIX.sub("", line).strip()
        if text.startswith("+"):  # a separator: the end of a table once it has rows
            if rows:
                tables.append(ProtoTable(titles[0], " ".join(titles[1:]), tuple(rows)))
                titles, rows = [], None
            continue
        if not text.startswith("|"):
            titles, rows = [], None
            continue
        cells = [c.strip() for c in text.strip("|").split("|")]
        if len(cells) == 1:
            titles, rows = (titles if rows is None else []) + cells, None
        elif cells[0] == "Range":
            rows = []
        elif rows is not None and len(cells) == 3 and (span := _span(cells[0])):
            rows.append(ProtoRow(*span, cells[1], cells[2]))
    return [t for t in tables if t.scope and t.operation]


def chosen(log: str, operation: str, sizes: tuple[int, int]) -> str | None:
    """What a UCX log says carried `operation` for messages of `sizes` bytes (smallest, largest).

    Args:
        log: the text UCX wrote with `UCX_PROTO_INFO=y`.
        operation: how the table's operation starts, e.g. "remote memory read" (ucp_get), "remote memory
            write" (ucp_put).
        sizes: the smallest and largest message the transfer posted.
    Returns:
        "<operation>: <description> <config>" for each table of that operation (the worker's loopback
        to itself left out), its rows that cover those sizes ("; "-separated, each with its byte range
        where several do), tables joined by " | "; None when the log has no such table.
    """
    lo, hi = sizes
    found: list[str] = []
    for table in parse_tables(log):
        if table.to_self or not table.operation.startswith(operation):
            continue
        hits = [r for r in table.rows if r.lo <= hi and lo <= r.hi]
        if hits:
            found.append(f"{table.operation}: " + "; ".join(
                (f"[{_span_text(r)}] " if len(hits) > 1 else "") + f"{r.description} {r.config}" for r in hits))
    return " | ".join(dict.fromkeys(found)) or None


def notices(log: str) -> list[str]:
    """UCX's warnings and errors in a log, without their prefixes (they went to the log, not the console)."""
    return [_PREFIX.sub("", line).strip() for line in log.splitlines()
            if " UCX  WARN " in line or " UCX  ERROR " in line]


def _span(cell: str) -> tuple[float, float] | None:
    bounds = [_size(p) for p in cell.split("..")]
    lo, hi = bounds[0], bounds[-1]
    if len(bounds) > 2 or lo is None or hi is None:
        return None
    return lo, hi


def _size(text: str) -> float | None:
    if text == "inf":
        return float("inf")
    m = _SIZE.match(text)
    return int(m.group(1)) * _UNITS[m.group(2)] if m else None


def _span_text(row: ProtoRow) -> str:
    hi = "inf" if row.hi == float("inf") else str(int(row.hi))
    return str(int(row.lo)) if row.lo == row.hi else f"{int(row.lo)}..{hi}"
