import msgspec
import pytest

from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.wire import (
    WIRE_VERSION,
    DType,
    KVLayout,
    KVLocation,
    NodeInfo,
    PullReply,
    PullRequest,
    TensorDesc,
    WireError,
    decode,
    encode,
)
from kvwire.protocol.work import DecodeWork, SamplingParams, TokenChunk

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=DType.BFLOAT16)

MESSAGES = [
    LAYOUT,
    KVLocation(request_id="r1", producer="p", producer_epoch=3, kind=ConnectorKind.UCX, side_channel="tcp://x:1",
               transport_address=b"\x00\x01addr", layout=LAYOUT, block_ids=[5, 6, 9], num_tokens=40,
               hidden=[TensorDesc("hidden_states", DType.FLOAT32, (40, 64))]),
    NodeInfo(node_id="d", role=NodeRole.DECODE, epoch=1, work_endpoint="tcp://127.0.0.1:9",
             connector=ConnectorKind.UCX, free_blocks=3, total_blocks=4),
    PullRequest(request_id="r", transfer_id=2**40, consumer="d", transport_address=b"a", dst_block_ids=[1, 2]),
    PullReply(request_id="r", transfer_id=1, ok=False, reason="expired"),
    DecodeWork(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(seed=4), prefill_node="p",
               reply_to="tcp://127.0.0.1:5"),
    TokenChunk(request_id="r", token_ids=[3], finished=True, finish_reason="length"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_expect_rejects_other_types():
    with pytest.raises(WireError, match="unexpected message type"):
        decode(encode(MESSAGES[4]), expect=PullRequest)


@pytest.mark.parametrize("data", [
    b"", b"\xff\xff\xff", b"\x92", encode(MESSAGES[3])[:-3],  # garbage, truncated
    msgspec.msgpack.encode([WIRE_VERSION, {"type": "no-such-tag"}]),  # unknown tag
    msgspec.msgpack.encode([WIRE_VERSION, {"type": "pull_reply", "request_id": 5, "transfer_id": 1, "ok": True}]),
    msgspec.msgpack.encode([WIRE_VERSION, {"type": "pull_reply", "transfer_id": 1}]),  # missing field
    msgspec.msgpack.encode([WIRE_VERSION, "not a struct"]),
    msgspec.msgpack.encode({"version": WIRE_VERSION}),
])
def test_malformed_bytes_are_rejected(data):
    with pytest.raises(WireError):
        decode(data)


def test_wrong_wire_version_is_named():
    data = msgspec.msgpack.encode([WIRE_VERSION + 1, msgspec.to_builtins(MESSAGES[4])])
    with pytest.raises(WireError, match=f"wire version {WIRE_VERSION + 1}"):
        decode(data)


def test_oversized_message_is_rejected_before_parsing():
    with pytest.raises(WireError, match="exceeds"):
        decode(b"\x00" * (16 << 20 + 1))
