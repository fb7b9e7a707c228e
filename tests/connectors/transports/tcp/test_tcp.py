"""TCP transport specifics: iovec batching and partial calls, header checks, broken connections.

The producer here is the real transfer server with the TCP send engine, in this
process; the consumer is the real puller. Streams that no real producer would send
come from `_FakeProducer`, which speaks the handshake and then writes what a test says.
"""

from __future__ import annotations

import queue
import random
import secrets
import select
import socket
import threading
import time

import pytest
import torch
import zmq

from kvwire.connectors.base import TransferError
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.producer.held import HeldRequest, HeldTable
from kvwire.connectors.producer.transfer_server import TransferServer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.transports.tcp import send_engine as tcp_engine
from kvwire.connectors.transports.tcp.frames import (
    ACK,
    DATA_MAGIC,
    HEADER,
    HELLO,
    HELLO_MAGIC,
    IOV_MAX,
    encode_address,
    parse_address,
)
from kvwire.connectors.transports.tcp.puller import TCPPuller
from kvwire.connectors.transports.tcp.send_engine import TCPSendEngine
from kvwire.connectors.transports.tcp.stream import ByteStream, Staging, byte_parts
from kvwire.connectors.wire import DType, KVLocation, PullReply, PullRequest, TensorDesc, decode, encode
from tests.connectors import peer

LAYOUT = peer.layout(DType.FLOAT32, layers=4, block_size=16)  # 8 KiB blocks
NUM_BLOCKS = 2600


def _pool() -> KVPool:
    return KVPool.allocate(LAYOUT, NUM_BLOCKS)


def _loc(rid: str, blocks: list[int], side_channel: str, address: bytes, hidden: list[torch.Tensor]) -> KVLocation:
    descs = [TensorDesc("hidden_states", DType.FLOAT32, tuple(h.shape)) for h in hidden]
    return KVLocation(request_id=rid, producer="p", producer_epoch=1, kind=ConnectorKind.TCP,
                      side_channel=side_channel, transport_address=address, layout=LAYOUT, block_ids=blocks,
                      num_tokens=len(blocks) * LAYOUT.block_size, hidden=descs)


class _Producer:
    """The real transfer server + TCP engine over a random pool, in this process."""

    def __init__(self) -> None:
        self.pool = _pool()
        self.pool.data.copy_(torch.randn(self.pool.data.shape))
        self.released: queue.SimpleQueue[tuple[str, list[int]]] = queue.SimpleQueue()
        self.held = HeldTable(lambda rid, blocks: self.released.put((rid, blocks)))
        self.blocks: dict[str, list[int]] = {}
        self.endpoints: dict[str, bytes] = {}
        self.hidden: dict[str, torch.Tensor] = {}
        self.server = TransferServer("127.0.0.1", KVRegion.from_kv_caches(self.pool.kv_caches), self.held,
                                     TCPSendEngine("127.0.0.1"), 10.0, self.endpoints.get)
        self.server.start()

    def hold(self, rid: str, blocks: list[int], hidden_rows: int = 3) -> KVLocation:
        hidden = [torch.randn(hidden_rows, 5)]
        loc = _loc(rid, blocks, self.server.side_channel, self.server.transport_address, hidden)
        self.held.add(HeldRequest(loc, hidden, deadline=time.monotonic() + 60))
        self.hidden[rid] = hidden[0]
        self.blocks[rid] = blocks
        return loc

    def wait_released(self, rid: str, timeout: float = 10.0) -> None:
        assert self.released.get(timeout=timeout) == (rid, self.blocks[rid])


@pytest.fixture
def producer():
    prod = _Producer()
    yield prod
    prod.server.close()


@pytest.fixture
def consumer(producer):
    pool = _pool()
    puller = TCPPuller("c", KVRegion.from_kv_caches(pool.kv_caches))
    producer.endpoints["c"] = puller.transport_address
    yield pool, puller
    puller.close()


def _pull(puller: TCPPuller, loc: KVLocation, dst: list[int], deadline_s: float = 10.0) -> torch.Tensor:
    hidden = torch.empty(loc.hidden[0].shape)
    puller.pull(loc, dst, [hidden], time.monotonic() + deadline_s)
    return hidden


# --- the cursor ---------------------------------------------------------------------------


def _split(data: torch.Tensor, rng: random.Random, max_piece: int) -> list[torch.Tensor]:
    pieces, i = [], 0
    while i < data.numel():
        n = rng.choice([0, 1, rng.randint(1, max_piece)])
        pieces.append(data[i:i + n])
        i += n
    return pieces


def _move(out: ByteStream, into: ByteStream) -> tuple[list[int], int]:
    """Send `out` into `into` over non-blocking loopback TCP with a small send buffer.

    Returns:
        (buffers per sendmsg call, number of sendmsg calls that moved some but not all).
    """
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    a.setblocking(False)
    b.setblocking(False)
    sizes, partial = [], 0
    try:
        while not into.done:
            if not out.done:
                batch = out.batch()
                sizes.append(len(batch))
                try:
                    n = a.sendmsg(batch)
                except BlockingIOError:
                    n = 0
                partial += 0 < n < sum(v.nbytes for v in batch)
                out.advance(n)
            assert select.select([b], [], [], 5)[0], "stream stalled"
            into.advance(b.recvmsg_into(into.batch())[0])
    finally:
        a.close()
        b.close()
    return sizes, partial


def test_stream_batches_at_most_iov_max_and_resumes_partial_calls():
    rng = random.Random(1)
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    out = ByteStream(byte_parts(_split(src, rng, 4000)), outbound=True, staging=Staging())  # > 1024 per 3 MiB
    into = ByteStream(byte_parts(_split(dst, rng, 900)), outbound=False, staging=Staging())  # other boundaries
    sizes, partial = _move(out, into)
    assert torch.equal(src, dst)
    assert max(sizes) == IOV_MAX and partial > 0


def test_batches_stop_at_max_bytes_and_resume_mid_piece():
    parts = byte_parts([torch.zeros(100, dtype=torch.uint8) for _ in range(50)])
    stream = ByteStream(parts, outbound=True, staging=Staging())
    assert [v.nbytes for v in stream.batch(max_bytes=250)] == [100, 100, 100]
    stream.advance(130)
    assert [v.nbytes for v in stream.batch(max_buffers=3)] == [70, 100, 100]
    assert [v.nbytes for v in stream.batch(max_bytes=1)] == [70]
    stream.advance(4870)
    assert stream.done and stream.moved_any


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_parts_pass_through_the_staging_buffer_in_chunks():
    rng = random.Random(2)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    src_parts = [p.cuda() if i % 2 else p for i, p in enumerate(_split(src, rng, 50_000))]
    dst_parts = [torch.zeros_like(p, device="cuda" if i % 3 else "cpu")
                 for i, p in enumerate(_split(torch.empty_like(src), rng, 70_000))]
    out = ByteStream(byte_parts(src_parts), outbound=True, staging=Staging(4096))
    into = ByteStream(byte_parts(dst_parts), outbound=False, staging=Staging(3000))
    _move(out, into)
    assert torch.equal(torch.cat([p.cpu() for p in dst_parts]), src)


def _device_like(parts: list[torch.Tensor]) -> list:
    """Tensor parts as a stream holds device memory (CPU tensors stand in: the same staging path, copies done
    at once); byte_parts would make them host memoryviews."""
    return [p.contiguous().view(-1).view(torch.uint8) for p in parts]


def test_device_parts_round_trip_in_alternating_chunks_with_host_parts_between():
    """Device parts (many per chunk, one larger than a chunk, empty ones) around host parts, over loopback TCP
    with partial calls: byte for byte, the last part a host one (the last chunk's scatter is in by then)."""
    rng = random.Random(3)
    src = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
    src_split, dst_split = _split(src, rng, 9000), _split(torch.zeros_like(src), rng, 7000)
    dst = torch.cat(dst_split)  # contiguous copy to read back from: the split views are what the stream fills
    src_parts = [memoryview(p.numpy()) if i % 5 == 4 else p for i, p in enumerate(_device_like(src_split))]
    dst_parts = [memoryview(p.numpy()) if i % 7 == 6 else p for i, p in enumerate(_device_like(dst_split))]
    dst_parts.append(memoryview(bytearray(0)))  # ends on a host part
    out = ByteStream(src_parts, outbound=True, staging=Staging(20_000, pinned=False))
    into = ByteStream(dst_parts, outbound=False, staging=Staging(30_000, pinned=False))
    _move(out, into)
    got = torch.cat([torch.frombuffer(p, dtype=torch.uint8) if isinstance(p, memoryview) and len(p) else
                     (p if isinstance(p, torch.Tensor) else torch.empty(0, dtype=torch.uint8)) for p in dst_parts])
    assert got.numel() == dst.numel() and torch.equal(got, src)


def test_device_staging_reads_nothing_past_the_limit_and_gathers_the_next_chunk_ahead():
    """A layer-wise stream's device parts: a chunk never holds bytes past what may be sent (layers the forward
    has not written), and once they may, the chunk after the one being sent is gathered while it is sent."""
    layers = [torch.zeros(4, 100, dtype=torch.uint8) for _ in range(3)]  # 3 layers of 4 pieces of 100 bytes
    parts = _device_like([row for layer in layers for row in layer])
    stream = ByteStream(parts, outbound=True, staging=Staging(1600, pinned=False))  # chunks of 800 bytes
    layers[0].fill_(1)  # layer 0 is written; layers 1 and 2 not yet
    first = stream.batch(limit=400)[0]
    assert bytes(first) == b"\x01" * 400
    stream.advance(400)
    layers[1].fill_(2)
    layers[2].fill_(3)
    second = stream.batch(limit=400)[0]  # layer 1 only, though a chunk holds 800 bytes
    assert bytes(second) == b"\x02" * 400
    stream.advance(100)
    rest = stream.batch(limit=800)[0]  # both layers may go now: layer 2 is gathered ahead of the send ...
    layers[2].fill_(9)  # ... so a write after that is not seen (none comes in a real stream: it is final)
    stream.advance(len(rest))
    assert bytes(stream.batch(limit=400)[0]) == b"\x03" * 400


class _Copy:
    """A device copy that a stream left running (a CUDA event, as far as Staging cares)."""

    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True


def test_a_half_is_written_again_only_once_its_last_copy_is_complete():
    """A stream's copies may still run once it has moved its bytes (on a GPU); the next stream over the same
    staging waits for a half's copy before it receives into that half, and a receiving stream is done only once
    every copy through the staging is complete."""
    staging = Staging(200, pinned=False)
    copies = [_Copy(), _Copy()]
    staging.pending(0, copies[0])
    staging.pending(1, copies[1])
    stream = ByteStream(_device_like([torch.zeros(60, dtype=torch.uint8)]), outbound=False, staging=staging)
    assert len(stream.batch()[0]) == 60  # into half 0 ...
    assert copies[0].waited and not copies[1].waited  # ... once its copy was complete
    stream.advance(60)
    assert stream.done and copies[1].waited


def test_addresses_round_trip_and_junk_is_refused():
    assert parse_address(encode_address("127.0.0.1", 5)) == ("127.0.0.1", 5)
    assert parse_address(encode_address("::1", 65535)) == ("::1", 65535)
    for junk in (b"", b"host", b"host:0", b"host:http", b":80", b"\xff:1"):
        with pytest.raises(ValueError):
            parse_address(junk)


# --- real producer, real puller -------------------------------------------------------------


def test_more_pieces_than_iov_max_arrive_byte_exact(producer, consumer):
    pool, puller = consumer
    src = list(range(0, NUM_BLOCKS, 2))  # 1300 runs of one block on both sides: 1301 pieces, 10 MiB
    dst = list(range(1, NUM_BLOCKS, 2))
    loc = producer.hold("many", src)
    hidden = _pull(puller, loc, dst)
    assert torch.equal(pool.data[dst], producer.pool.data[src])
    assert torch.equal(hidden, producer.hidden["many"])
    producer.wait_released("many")


def test_connection_is_kept_across_pulls(producer, consumer):
    pool, puller = consumer
    for i in range(3):
        loc = producer.hold(f"r{i}", [10 * i, 10 * i + 1])
        _pull(puller, loc, [500 + i, 700 + i])
        assert torch.equal(pool.data[[500 + i, 700 + i]], producer.pool.data[[10 * i, 10 * i + 1]])
    assert len(producer.server._engine._conns) == 1  # test-only reach: one data connection served all three


def test_consumer_that_disconnects_mid_send_leaves_producer_serving(producer, consumer):
    pool, puller = consumer
    token = secrets.token_bytes(16)
    producer.endpoints["rude"] = token
    big = producer.hold("big", list(range(0, 2000)))  # 16 MiB: more than both socket buffers hold
    ctl = zmq.Context.instance().socket(zmq.DEALER)
    ctl.setsockopt(zmq.LINGER, 0)
    try:
        with socket.create_connection(parse_address(producer.server.transport_address), timeout=5) as rude:
            rude.sendall(HELLO.pack(HELLO_MAGIC, token))
            assert rude.recv(len(ACK), socket.MSG_WAITALL) == ACK
            ctl.connect(producer.server.side_channel)
            ctl.send(encode(PullRequest(request_id="big", transfer_id=1, consumer="rude", transport_address=token,
                                        dst_block_ids=big.block_ids)))
            assert len(rude.recv(HEADER.size + 4096, socket.MSG_WAITALL)) == HEADER.size + 4096
        # closed with unread data: the producer's next write or wake-up fails, and it says so
        assert ctl.poll(5000)
        reply = decode(ctl.recv(), expect=PullReply)
        assert not reply.ok and "TCP data connection" in reply.reason
    finally:
        ctl.close()
    producer.wait_released("big")
    loc = producer.hold("next", [2100, 2101, 2102])
    _pull(puller, loc, [3, 4, 5])
    assert torch.equal(pool.data[[3, 4, 5]], producer.pool.data[[2100, 2101, 2102]])


def test_pull_without_a_data_connection_is_refused(producer):
    ctl = zmq.Context.instance().socket(zmq.DEALER)
    ctl.setsockopt(zmq.LINGER, 0)
    producer.endpoints["ghost"] = b"t" * 16
    producer.hold("g", [1])
    try:
        ctl.connect(producer.server.side_channel)
        ctl.send(encode(PullRequest(request_id="g", transfer_id=1, consumer="ghost", transport_address=b"t" * 16,
                                    dst_block_ids=[1])))
        assert ctl.poll(5000)
        reply = decode(ctl.recv(), expect=PullReply)
        assert not reply.ok and "no TCP data connection" in reply.reason
    finally:
        ctl.close()


def test_silent_or_bad_hello_connections_are_closed(producer, monkeypatch):
    monkeypatch.setattr(tcp_engine, "HANDSHAKE_TIMEOUT_S", 0.2)
    address = parse_address(producer.server.transport_address)
    with socket.create_connection(address, timeout=5) as bad, socket.create_connection(address, timeout=5) as mute:
        bad.sendall(b"GET / HTTP/1.1\r\nHost: kvwire\r\n"[:HELLO.size])
        assert bad.recv(1) == b""  # closed at once: wrong magic, no ACK
        start = time.monotonic()
        assert mute.recv(1) == b""  # closed at the handshake timeout (checked at least once a second)
        assert time.monotonic() - start < 2.5


# --- streams no real producer sends ------------------------------------------------------------


class _FakeProducer:
    """Handshakes like a producer, then answers each pull by writing `stream(msg)` and replying ok."""

    def __init__(self, stream, hang_up: bool = False) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._ctl = zmq.Context.instance().socket(zmq.ROUTER)
        self._ctl.setsockopt(zmq.LINGER, 0)
        self.side_channel = f"tcp://127.0.0.1:{self._ctl.bind_to_random_port('tcp://127.0.0.1')}"
        self.address = encode_address(*self._listener.getsockname())
        self.conn: socket.socket | None = None
        self._stream, self._hang_up = stream, hang_up
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(10)
        self.conn, _ = self._listener.accept()
        self.conn.settimeout(10)
        assert self.conn.recv(HELLO.size, socket.MSG_WAITALL)[:8] == HELLO_MAGIC
        self.conn.sendall(ACK)
        if self._ctl.poll(10_000):
            identity, payload = self._ctl.recv_multipart()
            msg = decode(payload, expect=PullRequest)
            self.conn.sendall(self._stream(msg))
            if self._hang_up:
                self.conn.shutdown(socket.SHUT_WR)
            reply = PullReply(request_id=msg.request_id, transfer_id=msg.transfer_id, ok=True)
            self._ctl.send_multipart([identity, encode(reply)])

    def close(self) -> None:
        self._thread.join(10)
        self._ctl.close(0)
        self._listener.close()
        if self.conn is not None:
            self.conn.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


BLOCK = KVPool.allocate(LAYOUT, 1).block_nbytes
TOTAL = 2 * BLOCK + 3 * 5 * 4  # two blocks and a [3, 5] float32 hidden tensor


@pytest.mark.parametrize("header, match", [
    (lambda m: HEADER.pack(b"HTTP/1.1", m.transfer_id, TOTAL), "magic"),
    (lambda m: HEADER.pack(DATA_MAGIC, m.transfer_id + 7, TOTAL), "transfer"),
    (lambda m: HEADER.pack(DATA_MAGIC, m.transfer_id, TOTAL + 1), "bytes"),
])
def test_bogus_header_is_rejected_and_the_connection_dropped(header, match):
    _rejected(_FakeProducer(lambda m: header(m) + b"\xab" * 4096), match)


def test_stream_cut_short_is_rejected():
    _rejected(_FakeProducer(lambda m: HEADER.pack(DATA_MAGIC, m.transfer_id, TOTAL)[:10], hang_up=True),
              "closed the data connection mid-transfer")


def _rejected(fake: _FakeProducer, match: str) -> None:
    pool = _pool()
    puller = TCPPuller("c", KVRegion.from_kv_caches(pool.kv_caches))
    try:
        loc = _loc("bogus", [1, 2], fake.side_channel, fake.address, [torch.zeros(3, 5)])
        with pytest.raises(TransferError, match=match) as err:
            _pull(puller, loc, [7, 9], deadline_s=5)
        assert err.value.request_id == "bogus" and err.value.peer == "p"
        assert not pool.data.any(), "payload of a rejected stream reached the blocks"
        fake._thread.join(10)
        assert _closed_by_peer(fake.conn)  # the puller dropped the data connection
    finally:
        puller.close()
        fake.close()


def test_stalled_stream_ends_at_the_deadline():
    fake = _FakeProducer(lambda m: HEADER.pack(DATA_MAGIC, m.transfer_id, TOTAL) + b"\x01" * BLOCK)
    pool = _pool()
    puller = TCPPuller("c", KVRegion.from_kv_caches(pool.kv_caches))
    try:
        loc = _loc("stall", [1, 2], fake.side_channel, fake.address, [torch.zeros(3, 5)])
        start = time.monotonic()
        with pytest.raises(TransferError, match="deadline"):
            _pull(puller, loc, [7, 9], deadline_s=0.5)
        assert 0.45 <= time.monotonic() - start < 1.5
        fake._thread.join(10)
        assert _closed_by_peer(fake.conn)
    finally:
        puller.close()
        fake.close()
