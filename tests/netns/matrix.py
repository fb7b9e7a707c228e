"""The fault matrix of the two-host tests: counts per (fault, connector), printed at the session's end."""

from __future__ import annotations

from kvwire.connectors.config import ConnectorKind
from tests.faults.harness import Tally

MATRIX: dict[tuple[str, str], Tally] = {}


def record(fault: str, connector: ConnectorKind, tally: Tally) -> None:
    MATRIX.setdefault((fault, str(connector)), Tally()).add(tally)


def table() -> list[str]:
    lines = ["| fault | connector | requests | completed exact | of which recomputed | failed retryable | lost "
             "| leaked |", "|---|---|---|---|---|---|---|---|"]
    for (fault, connector), t in MATRIX.items():
        lines.append(f"| {fault} | {connector} | {t.requests} | {t.completed} | {t.recomputed} | {t.errors} "
                     f"| {t.lost} | {t.leaked_blocks} |")
    return lines
