"""vLLM's KV cache events, read by the router: a decode instance's prefix cache as it changes (vLLM's
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'`), for an
exact prefix index (router/prefix_index.py).

Lifecycle of one instance's stream (`follow`):

1. A ZMQ SUB socket connects to the instance's publisher (and reconnects by itself when the server restarts).
2. Each message is (topic, sequence number, a msgpack `KVEventBatch`). Its events go, in order, to `apply`:
   BlockStored, BlockRemoved, AllBlocksCleared. The first message makes the instance EXACT in the index.
3. A gap in the sequence numbers (messages dropped, or a restarted server counting from 0 again) is reported
   to `apply` as an AllBlocksCleared first: the instance is taken to hold nothing until its next events.
4. A message that does not decode is logged and skipped. Peers' bytes are data: msgspec decodes them into
   the structs below, nothing else.
5. Cancelled with the router: the socket closes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

VLLMBlockHash = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    """Blocks `block_hashes` of `token_ids` entered the prefix cache, after the block `parent_block_hash`."""

    block_hashes: list[VLLMBlockHash]
    parent_block_hash: VLLMBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # vLLM's deprecated name for the adapter: `lora_name` is the one it hashes
    lora_name: str | None = None  # the LoRA adapter the blocks were computed with; None: the base model
    # per block, vLLM's untagged extra keys (router/vllm/cache_scope.py), each item left as its msgpack bytes
    extra_keys: list[list[msgspec.Raw] | None] | None = None
    group_idx: int | None = None  # the KV cache group (hybrid models); None: the only one


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[VLLMBlockHash]
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises: msgspec.DecodeError (msgspec.ValidationError included): not a KVEventBatch."""
    return _DECODER.decode(payload)


class SeqOrder:
    """The sequence numbers of one stream: whether a message follows the one before."""

    def __init__(self) -> None:
        self._next: int | None = None

    def follows(self, seq: int) -> bool:
        """Returns: False when messages were missed (or the publisher restarted) before `seq`."""
        gap = self._next is not None and seq != self._next
        self._next = seq + 1
        return not gap


async def follow(endpoint: str, url: str, apply: Callable[[str, Sequence[KVEvent]], None]) -> None:
    """Apply the KV events the instance `url` publishes at `endpoint`, until cancelled (module docstring)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    order = SeqOrder()
    try:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("vLLM instance %s: a KV event message of %d frames from %s skipped", url, len(frames),
                            endpoint)
                continue
            if not order.follows(int.from_bytes(frames[1], "big")):
                log.warning("vLLM instance %s: KV events missed (or its server restarted); its prefix cache is "
                            "taken as empty until its next events", url)
                apply(url, [AllBlocksCleared()])
            try:
                batch = decode_batch(frames[2])
            except msgspec.DecodeError as exc:
                log.warning("vLLM instance %s: a KV event batch from %s that does not decode skipped: %s", url,
                            endpoint, exc)
                continue
            apply(url, batch.events)
    finally:
        sock.close(0)
