"""Keep Python's garbage collector from pausing a node in the middle of a transfer.

Once a node has started it holds a large heap of objects that live as long as the
process (torch, the model, the connector and its transports). Python's oldest-generation
collection walks all of them, and the allocations of transfers and decode steps trigger
it every few requests: a collection that lands inside a pull, in either process,
stretches that pull to several times its usual length (docs/BENCHMARKS.md).
`freeze_startup_heap`, called once start-up is over, moves that heap to the permanent
generation, which collections skip (vLLM's engine core does the same after start-up);
whatever is allocated later is still collected as usual. The router does the same before it serves (cli/router_cmd.py).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    gc.collect()  # garbage from start-up is freed, not frozen
    gc.freeze()
