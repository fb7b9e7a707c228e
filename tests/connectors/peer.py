"""A producer process for connector tests: fills its pool, publishes requests, serves pulls."""

from __future__ import annotations

import threading
import zlib

import torch

from connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from connectors.factory import create_connector
from connectors.types import IntermediateTensors
from connectors.wire import DType, KVLayout
from engine.kv_cache import TORCH_DTYPES, KVPool
from engine.model_input import ModelInput, SequenceInput

HIDDEN = 24


def layout(dtype: DType = DType.FLOAT32, layers: int = 3, block_size: int = 4) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=dtype)


def request_kv(rid: str, lay: KVLayout, n_blocks: int) -> torch.Tensor:
    """Deterministic random KV of one request: [n_blocks, layers, 2, block_size, heads, head_dim]."""
    gen = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    shape = (n_blocks, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return torch.randn(shape, generator=gen).to(TORCH_DTYPES[lay.dtype])


def request_hidden(rid: str, tokens: int, intermediate: bool):
    gen = torch.Generator().manual_seed(zlib.crc32(rid.encode()) + 1)
    h = torch.randn(tokens, HIDDEN, generator=gen)
    if intermediate:
        return IntermediateTensors({"hidden_states": h, "residual": h * 2})
    return h


def produce(redis_url: str, lay: KVLayout, requests: list[tuple[str, int, list[int]]], intermediate: bool,
            deadline_s: float, results) -> None:
    """Publish each (request_id, num_tokens, src_blocks); report released ids when all are released."""
    torch.manual_seed(0)
    config = ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.PREFILL, node_id="producer-test",
                             redis_url=redis_url, kv_deadline_s=deadline_s)
    conn = create_connector(0, 0, config)
    pool = KVPool.allocate(lay, 64)
    released, done = [], threading.Event()

    def on_release(rid: str) -> None:
        released.append(rid)
        if len(released) == len(requests):
            done.set()

    conn.set_release_callback(on_release)
    conn.register_kv_caches(pool.kv_caches)
    for rid, tokens, blocks in requests:
        pool.data[blocks] = request_kv(rid, lay, len(blocks))
        hidden = request_hidden(rid, tokens, intermediate)
        conn.send_kv_caches_and_hidden_states(None, ModelInput([SequenceInput(rid, [0] * tokens, 0, blocks)]),
                                              pool.kv_caches, hidden)
    results.put(("published", len(requests)))
    done.wait(deadline_s * 3 + 10)
    results.put(("released", sorted(released)))
    conn.close()
