"""The demo's table: a row whose prompt was computed on decode says why, from the answer's kvwire object."""

from __future__ import annotations

from kvwire.cli.demo_cmd import Row, _table

BASE = {"transport": None, "kv_bytes": 0, "transfer_ms": 0.0, "ttft_ms": 9.0}


def test_a_prompt_not_bypassed_says_why():
    rows = [Row(3, [1, 2], [1, 2], {**BASE, "bypassed": True, "transport": "shm", "kv_bytes": 10, "transfer_ms": 0.1}),
            Row(3, [1, 2], [1, 2], {**BASE, "bypassed": False, "transfer_failure": "deadline", "reason": "prefilled"}),
            Row(3, [1, 2], [1, 2], {**BASE, "bypassed": False, "transfer_failure": None,
                                    "reason": "no-prefill-instance"})]
    lines = _table(rows).splitlines()[2:]
    assert lines[0].endswith("yes")
    assert lines[1].endswith("NO (transfer_failure deadline)")
    assert lines[2].endswith("NO (no-prefill-instance)")
