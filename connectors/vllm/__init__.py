"""kvwire as a vLLM V1 KV connector: `kv_connector_module_path` "kvwire.connectors.vllm", `kv_connector`
"KvwireConnector" (settings.py documents `kv_connector_extra_config`).

vLLM is imported only when vLLM asks for the class, so kvwire itself never needs it.

    connector.py  KvwireConnector: routes vLLM's calls to the two halves
    scheduler.py  SchedulerHalf: which prompts are pulled, held, and the params handed back
    worker.py     WorkerHalf: kvwire's producer and consumer over vLLM's KV tensors
    identity.py   which name an engine takes in the directory; shapes and duplicates refused
    stats.py      what vLLM's /metrics gets: pulls, and prompts recomputed by reason (tally.py counts)
    layout.py     vLLM's per-layer KV tensors as kvwire planes
    groups.py     vLLM's KV cache groups (hybrid attention): which blocks of each a pull moves
    tp.py         tensor parallel: which prefill ranks' head slices each decode rank reads
    params.py     the kv_transfer_params a P/D proxy carries from prefill to decode
    metadata.py   what the scheduler half tells the worker half each step
    settings.py   kv_connector_extra_config
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvwireConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvwireConnector":
        try:
            from kvwire.connectors.vllm.connector import KvwireConnector
        except ImportError as exc:
            raise ImportError(f"kvwire.connectors.vllm.KvwireConnector needs vLLM installed: {exc}") from exc
        return KvwireConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
