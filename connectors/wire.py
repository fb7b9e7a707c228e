"""Every message that crosses a process boundary, as tagged msgspec structs.

Peers' bytes are data, never code: `decode` accepts only the structs listed in
`Message` or in a union `register`ed here (kvwire.protocol's router ↔ node work, which
rides the same envelope), checks the wire version, and raises `WireError` on anything else.
Tensors never travel inside these messages; they move as raw buffers over the
transport, described here by `TensorDesc`.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar, overload

import msgspec

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.observability.labels import TransferFailure

WIRE_VERSION = 1
M = TypeVar("M")
MAX_MESSAGE_BYTES = 16 << 20  # no control message is legitimately larger


class WireError(ValueError):
    """A peer sent bytes that are not a valid message of this wire version."""


class DType(enum.StrEnum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    # a quantized KV cache's storage (vLLM's fp8 caches are uint8 tensors); KVLayout.kv_quant says what it encodes
    UINT8 = "uint8"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"


class PoolLayout(enum.StrEnum):
    """How a node's KV pool sits in memory; both sides of a transfer must agree."""

    KVWIRE = "kvwire"  # one tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]: a block is one piece
    VLLM = "vllm"  # per layer [2, num_blocks, block_size, kv_heads, head_dim]: a block is 2 x num_layers pieces
    # vLLM's other per-layer layouts, one piece per layer and block (connectors/vllm/layout.py):
    VLLM_CPU = "vllm-cpu"  # CPU attention: [num_blocks, kv_heads, block_size, 2 * head_dim], K and V side by side
    VLLM_BLOCK_FIRST = "vllm-block-first"  # e.g. FlashInfer: [num_blocks, 2, block_size, kv_heads, head_dim]
    # vLLM >= 0.32 on GPUs under LBHNC/BLHNC: per layer [num_blocks, kv_heads, block_size, 2 * head_dim], each
    # token's K and V side by side; a block's heads one after another, like VLLM_CPU's (whose head holds its
    # block's K rows, then its V rows)
    VLLM_HNC = "vllm-hnc"
    VLLM_MLA = "vllm-mla"  # MLA: per layer [num_blocks, 1, block_size, latent]; KVLayout.head_dim is the latent width


class TensorDesc(msgspec.Struct, frozen=True, array_like=True):
    """A tensor that travels as a raw buffer: its name, dtype and shape."""

    name: str
    dtype: DType
    shape: tuple[int, ...]


class NodeEngine(enum.StrEnum):
    """What serves behind a registered node id: one of kvwire's own nodes, or a vLLM server's worker rank
    (kvwire.connectors.vllm; routers of kvwire's own nodes never send work to it)."""

    KVWIRE = "kvwire"
    VLLM = "vllm"


class _Msg(msgspec.Struct, frozen=True, tag=True, tag_field="type", kw_only=True):
    pass


# --- directory records (stored in Redis as msgpack) ---------------------------------


class KVLayout(_Msg, tag="layout", frozen=True):
    """Shape of one node's KV pool; both sides of a transfer must agree on it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: DType
    pool: PoolLayout = PoolLayout.KVWIRE
    # the checkpoint whose KV this is (engine/fingerprint.py): two models of one shape must not trade KV.
    # "": not known (older nodes), which agrees with any (`models_agree`)
    model: str = ""
    # a quantized KV cache: how its bytes encode values (vLLM's --kv-cache-dtype: fp8, fp8_e4m3, fp8_e5m2); both
    # sides must agree, as one uint8 byte is a value of either. "": a cache of the model's own dtype
    kv_quant: str = ""


UNQUANTIZED_KV = frozenset({"auto", "float16", "half", "bfloat16", "float32", "float"})  # vLLM's --kv-cache-dtype


def kv_quant_of(cache_dtype: str) -> str:
    """The `KVLayout.kv_quant` of vLLM's --kv-cache-dtype `cache_dtype`: "" for a cache of the model's dtype."""
    return "" if cache_dtype in UNQUANTIZED_KV else cache_dtype


def models_agree(a: str, b: str) -> bool:
    """Whether two checkpoint fingerprints (KVLayout.model, NodeInfo.model) name one checkpoint, as far as both
    know."""
    return not a or not b or a == b


class TransportOffer(msgspec.Struct, frozen=True, array_like=True):
    """One way to pull a request's KV from its producer."""

    kind: ConnectorKind
    side_channel: str  # zmq endpoint of the producer's transfer server for this transport
    transport_address: bytes


class ShmHold(msgspec.Struct, frozen=True, array_like=True):
    """A shared-memory producer's word that says a request's blocks are still held
    (connectors/transports/shm/hold_board.py).

    Word `slot` of the producer's hold board holds `token` from before the request is announced until
    its blocks are released; a consumer whose read of the pool began and ended with the word still
    `token` read blocks nobody had reused. The request's hidden states lie in the board's hidden area
    from byte `hidden_at` on, back to back in the location's `hidden` order (-1: not there).
    """

    slot: int
    token: int
    hidden_at: int = -1


class HeadSlice(msgspec.Struct, frozen=True, array_like=True):
    """A tensor-parallel pull's share of a block: KV heads `[src_head, src_head + num_heads)` of the producer's
    rank land at `dst_head` on among the consumer's (connectors/vllm/tp.py plans them).

    With `per_block` each block's slice travels as its own piece (KVRegion.heads): set unless the slice is
    every head on both sides. `pullers` consumer ranks pull this producer's copy of the request (each its own
    slice); the producer releases it once that many have ended. `num_heads` 0 declines: the consumer pulls
    nothing from this copy (a replica read elsewhere), and the producer counts it as one of the pullers.
    """

    src_head: int
    dst_head: int
    num_heads: int
    per_block: bool = True
    pullers: int = 1


class TransportCheck(msgspec.Struct, frozen=True, kw_only=True):
    """A node's start-up self-test of one transport it serves (connectors/self_test.py)."""

    transport: ConnectorKind
    ok: bool
    path: str  # what carried the bytes: "tcp", "shm", or what UCX selected ("sysv/cma"); "unknown"
    ms: float  # the loopback transfer's time, connecting included
    reason: str = ""  # why it failed, or why the path is unknown


class KVLocation(_Msg, tag="location", frozen=True):
    """Where one request's KV and hidden states live on its producer."""

    request_id: str
    producer: str
    producer_epoch: int
    kind: ConnectorKind
    side_channel: str  # zmq endpoint of the producer's transfer server
    transport_address: bytes  # e.g. the producer's UCX worker address
    layout: KVLayout
    block_ids: list[int]
    num_tokens: int
    hidden: list[TensorDesc]
    intermediate: bool = False  # hidden holds IntermediateTensors, not one tensor
    offers: list[TransportOffer] = []  # every transport the producer serves this KV over (auto)
    host: str = ""  # the producer's host identity (hostname and boot id)
    layer_checksums: list[int] = []  # crc32 per layer of the blocks, when the producer runs with --verify-kv
    # Layer-wise: published before the prefill forward; the producer sends the blocks layer by layer
    # (KVRegion.layer_major_parts) as layers are computed, then the hidden states. Consumers that do
    # not say `layer_major` in their PullRequest are refused, never sent bytes in an order they misread.
    layerwise: bool = False
    # A consumer's view only, never published: the pull starts at this block of the producer's list (the
    # consumer has the ones before it already, e.g. vLLM's prefix cache); block_ids then holds the rest.
    first_block: int = 0
    shm_hold: ShmHold | None = None  # shared memory: the request's hold word (None: claim before reading)
    # The KVReady only (KVReady), never published: the hidden states' bytes, back to back in `hidden`
    # order, when small; with `shm_hold` a same-host consumer reads the request without a round trip. A
    # consumer's view of a KVReady also holds here what its puller read ahead (SHMPuller.read_ahead).
    inline_hidden: bytes = b""
    # A consumer's view only, never published: the pull takes this head slice (tensor parallel, HeadSlice).
    heads: HeadSlice | None = None
    prompt: str = ""  # the fingerprint of the token ids the KV is of (connectors/prompt.py); "": not known
    # The producer serves pulls in blocks smaller than its own (PullRequest.block_size); False: an older one
    sub_blocks: bool = False
    # A consumer's view only, never published: the pull moves blocks of this many tokens, the smaller of the two
    # pools' block sizes (connectors/transports/sub_blocks.py); block_ids and first_block then count those; 0:
    # the layout's own blocks.
    pull_block_size: int = 0


class NodeInfo(_Msg, tag="node", frozen=True):
    """A live node's entry in the directory registry (refreshed by heartbeats)."""

    node_id: str
    role: NodeRole
    epoch: int
    work_endpoint: str = msgspec.field(name="work_address")  # zmq endpoint that takes PrefillWork / DecodeWork
    connector: ConnectorKind
    free_blocks: int
    total_blocks: int
    # Added after WIRE_VERSION 1 shipped; defaults keep older records readable.
    queue_depth: int = 0  # requests waiting (prefill: for blocks; decode: for KV or blocks)
    running: int = 0  # requests in progress (prefill: KV held for a pull; decode: generating)
    heartbeat_at: float = 0.0  # wall-clock time (time.time()) of the beat that wrote this; 0: unknown
    draining: bool = False  # shutting down: finishing what it holds, taking no new work (routers skip it)
    transport_checks: list[TransportCheck] = []  # its start-up transport self-test, one per transport served
    engine: NodeEngine = NodeEngine.KVWIRE
    host: str = ""  # host_identity() of the process behind the id ("": an older node)
    pid: int = 0  # its process id there (0: an older node)
    # A consumer's (a decode node, a vLLM server's consumer rank): its pulls so far, and the prompts it was meant to
    # receive and recomputed instead, by reason (connectors/consumer/totals.py). 0 and {} for producers.
    pulls: int = 0
    recomputed: dict[TransferFailure, int] = {}
    # a decode node's prompts kept on it as cached-on-decode that found fewer blocks in its prefix cache than the
    # router took it to hold (RecomputeReason.PREFIX_MISS): computed again there
    prefix_misses: int = 0
    block_size: int = 0  # tokens per KV block of its pool (0: an older node)
    prefix_cache: bool = False  # a decode node keeping computed blocks for later prompts (engine/block_allocator.py)
    # a decode node's consumer inbox (connectors/consumer/inbox.py): producers push its KVReady there ("": an
    # older node, told on its work endpoint)
    kv_ready_endpoint: str = msgspec.field(default="", name="kv_ready_address")
    model: str = ""  # its checkpoint's fingerprint (KVLayout.model); "": not known (vLLM, an older node)
    settling: int = 0  # a producer's failed pulls whose blocks stay held while their sends may still read them
    shares_prompts: bool = False  # a decode node that starts a request's later choices from its first one's prompt KV


# --- transfer side channel ---------------------------------------------------------------


class PullRequest(_Msg, tag="pull", frozen=True):
    """Consumer → producer: send request_id's KV into these blocks of mine.

    On a shared-memory producer's Unix socket it means instead: I am about to read
    request_id's blocks into these of mine; hold them for me (connectors/shm).
    """

    request_id: str
    transfer_id: int  # unique per consumer; the transport derives its tags from it
    consumer: str
    transport_address: bytes
    dst_block_ids: list[int]
    layer_major: bool = False  # the consumer lands a layer-wise location's blocks layer by layer
    # UCX: pieces smaller than this come packed, many per message (connectors/transports/ucx/packing.py)
    pack_below: int = 0
    first_block: int = 0  # send the location's blocks from this one on (KVLocation.first_block)
    heads: HeadSlice | None = None  # tensor parallel: send only these heads of each block (KVLocation.heads)
    # The location's blocks to send, in `dst_block_ids` order (each must be one the producer holds for the
    # request; first_block is then ignored): a consumer's pick, e.g. the blocks of each of vLLM's KV cache
    # groups that it lacks. Empty: every block from first_block on (as producers before it read it).
    src_block_ids: list[int] = []
    host: str = ""  # the consumer's host_identity() (UCX: error handling on between hosts); "": not said
    # UCX: this pull's endpoints have error handling on (the consumer's choice, connectors/transports/ucx/
    # worker.py); None: a consumer that did not say, on between hosts only
    guarded: bool | None = None
    # The consumer will not pull it (it refused the location, or failed before or during its pull): one puller
    # less and nothing delivered, so the producer releases the blocks now rather than at the hold deadline.
    abandon: bool = False
    # Send the location's blocks seen in blocks of this many tokens (KVLocation.pull_block_size): first_block,
    # src_block_ids and dst_block_ids then count those; 0: the producer's own blocks.
    block_size: int = 0
    # UCX: those sub-blocks travel packed back to back (sub_blocks.pack), one buffer in the message plan where
    # their pieces were thousands; a producer that cannot pack them refuses (a byte stream, tcp, always packs)
    packed: bool = False


class PullReply(_Msg, tag="pull_reply", frozen=True):
    """Producer → consumer: the pull finished (ok) or was refused (reason).

    For shared memory, where the consumer reads the producer's pool itself, ok means "the
    request is yours: its blocks stay held for you for hold_s seconds from now, or until
    your `ShmReadDone`"; a read that ends within hold_s of sending the claim stands.
    """

    request_id: str
    transfer_id: int
    ok: bool
    reason: str = ""
    hold_s: float = 0.0  # shared memory: how long the blocks stay held for the read
    inline_bytes: int = 0  # shared memory: the hidden states follow as one raw packet of this size (no memfd)


# --- shared-memory transport: the producer's Unix socket (connectors/shm) -------------------


class ShmHello(_Msg, tag="shm_hello", frozen=True):
    """Consumer → producer, first message on the producer's Unix socket."""

    consumer: str
    transport_address: bytes  # the one the consumer published: binds this connection to its pulls


class CudaIpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """What `UntypedStorage._share_cuda_()` returns, as plain data (never pickled)."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class ShmReadDone(_Msg, tag="shm_done", frozen=True):
    """Consumer → producer, after a claimed read (ok) or instead of it (not ok): release the blocks."""

    request_id: str
    transfer_id: int
    ok: bool


class ShmRead(_Msg, tag="shm_read", frozen=True):
    """Consumer → producer, no answer: I read request_id's blocks while its hold word stood (a read with no
    claim); the request is delivered to me, release its blocks."""

    request_id: str
    transfer_id: int
    consumer: str
    transport_address: bytes
    dst_block_ids: list[int]
    first_block: int = 0
    src_block_ids: list[int] = []  # the producer's blocks read, in dst order (PullRequest.src_block_ids)
    heads: HeadSlice | None = None  # tensor parallel: the head slice read (its `pullers` count)
    block_size: int = 0  # the blocks read were of this many tokens (PullRequest.block_size); 0: the producer's


class ShmAccess(enum.StrEnum):
    """How a consumer reaches a producer's pool (`ShmSegment.access`)."""

    MEMFD = "shm"  # kvwire's host pool: a read-only memfd attached to the ShmSegment, mapped
    CUDA_IPC = "cuda_ipc"  # device memory: the planes' allocations opened by CUDA IPC handle
    CMA = "cma"  # host memory kvwire did not allocate (vLLM's): read with process_vm_readv from the producer


class PlaneDesc(msgspec.Struct, frozen=True, array_like=True):
    """Where one plane of a producer's pool lies (`ShmSegment.planes`): rows of `ShmSegment.row_nbytes`."""

    storage: int  # CUDA IPC: index into `ShmSegment.storages`; cma: 0
    offset: int  # CUDA IPC: bytes from that storage's start; cma: the row 0 address in the producer's process
    row_stride: int  # bytes from one block's row to the next


class ShmSegment(_Msg, tag="shm_segment", frozen=True):
    """Producer → consumer, answer to `ShmHello`: the KV pool to map.

    A kvwire host pool comes as a read-only memfd attached to this message (SCM_RIGHTS); device
    planes as their allocations' IPC handles and where each plane lies in them; host planes kvwire
    did not allocate (vLLM's) as their addresses, which the consumer reads with process_vm_readv
    from the process at the other end of this socket (its SO_PEERCRED pid). Over the same socket
    the consumer then claims each request with a `PullRequest` and reads while the producer answers `PullReply` (ok: the
    blocks are held for the read; the hidden states ride along as a memfd), and says
    `ShmReadDone` once it has read. A request whose location carries a hold word and its hidden
    states (the KVReady) is read with no claim: the consumer checks the word before and after its
    copy and then says `ShmRead`.
    """

    producer: str
    epoch: int
    num_blocks: int
    block_nbytes: int  # every plane's row together
    access: ShmAccess = ShmAccess.MEMFD
    planes: list[PlaneDesc] = []  # CUDA IPC and cma: every plane, in the region's order (memfd: one, implied)
    storages: list[CudaIpcHandle] = []  # CUDA IPC: the allocations holding the planes
    hold_slots: int = 0  # words in the hold board, whose read-only memfd comes after the pool's (0: none)
    hold_hidden_bytes: int = 0  # the board's hidden area, from the first page after the words


# --- the KVReady: prefill → decode, on the decode node's work socket ---------------------


class KVReady(_Msg, tag="kv_ready", frozen=True):
    """Prefill → decode, on the decode node's work socket: the KV is where `location` says.

    The same location the directory's READY event carries, sent directly so the decode node
    need not wait for the directory's round trip; the directory stays the record (and the path
    when this message is lost or refused).
    """

    location: KVLocation


Message = (
    KVLayout | KVLocation | NodeInfo | PullRequest | PullReply | ShmHello | ShmSegment | ShmReadDone | ShmRead | KVReady
)
AnyMessage = _Msg  # a message of this module's, or of a union `register`ed with it (kvwire.protocol's)


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    body: msgspec.Raw  # one of the registered unions' messages, decoded in a second step


_registered: list[Any] = [Message]
_encoder = msgspec.msgpack.Encoder()
_version_probe = msgspec.msgpack.Decoder(tuple)


def _body_decoder() -> msgspec.msgpack.Decoder:
    union = _registered[0]
    for more in _registered[1:]:
        union = union | more
    return msgspec.msgpack.Decoder(union)


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_decoder = _body_decoder()


def register(union: Any) -> None:
    """Let `decode` accept `union`'s messages too: kvwire.protocol's (router ↔ node work) ride the same envelope
    and wire version as the transfer plane's, on sockets that carry both (a decode node's work socket)."""
    global _decoder
    if union not in _registered:
        _registered.append(union)
        _decoder = _body_decoder()


def encode(msg: AnyMessage) -> bytes:
    """Serialise one message with the current wire version."""
    return _encoder.encode(Envelope(WIRE_VERSION, msgspec.Raw(_encoder.encode(msg))))


@overload
def decode(data: bytes | memoryview, expect: type[M]) -> M: ...
@overload
def decode(data: bytes | memoryview, expect: tuple[type, ...] | None = None) -> AnyMessage: ...


def decode(data: bytes | memoryview, expect: type | tuple[type, ...] | None = None) -> Any:
    """Parse one message.

    Args:
        data: bytes received from a peer.
        expect: the message types acceptable here; others are rejected.
    Returns:
        The message.
    Raises:
        WireError: wrong version, malformed, oversized or unexpected message.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        env = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(_explain(data, exc)) from None
    if env.version != WIRE_VERSION:
        raise WireError(f"wire version {env.version!r} is not {WIRE_VERSION}")
    try:
        body = _decoder.decode(env.body)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed message: {exc}") from None
    if expect is not None and not isinstance(body, expect):
        raise WireError(f"unexpected message type {type(body).__name__}")
    return body


def _explain(data: bytes | memoryview, exc: Exception) -> str:
    try:
        version = _version_probe.decode(data)[0]
    except Exception:  # noqa: BLE001 - any failure means "not even an envelope"
        return f"malformed message: {exc}"
    if version != WIRE_VERSION:
        return f"wire version {version!r} is not {WIRE_VERSION}"
    return f"malformed message: {exc}"
