"""Sealing control messages: accepted with the right secret only, tampering and replays refused."""

from __future__ import annotations

import struct
import time

import pytest

from kvwire.connectors.control import auth
from kvwire.connectors.control.auth import AuthError
from kvwire.connectors.control.framing import pack, unpack
from kvwire.connectors.wire import PullReply, WireError, encode

SECRET = b"s" * 32
MSG = PullReply(request_id="r1", transfer_id=7, ok=True, reason="")


@pytest.fixture(autouse=True)
def no_secret_after():
    yield
    auth.install(None)


def test_without_a_secret_messages_travel_as_they_are():
    assert pack(MSG) == encode(MSG) and unpack(pack(MSG), PullReply) == MSG


def test_sealed_round_trip_and_unsealed_refused():
    auth.install(SECRET)
    assert unpack(pack(MSG), PullReply) == MSG
    before = auth.rejected_count()
    with pytest.raises(AuthError, match="not sealed"):
        unpack(encode(MSG), PullReply)  # a peer without the secret
    assert auth.rejected_count() == before + 1
    assert issubclass(AuthError, WireError)  # every receive path already drops WireErrors


def test_wrong_secret_and_tampering_refused():
    auth.install(b"o" * 32)
    other = pack(MSG)
    auth.install(SECRET)
    with pytest.raises(AuthError, match="bad seal"):
        unpack(other, PullReply)
    sealed = bytearray(pack(MSG))
    sealed[-1] ^= 1  # one bit of the payload
    with pytest.raises(AuthError, match="bad seal"):
        unpack(bytes(sealed), PullReply)
    with pytest.raises(AuthError):
        unpack(b"", PullReply)


def test_old_seal_refused_as_a_replay(monkeypatch):
    auth.install(SECRET)
    then = time.time_ns() - int((auth.MAX_SKEW_S + 5) * 1e9)
    monkeypatch.setattr(time, "time_ns", lambda: then)
    old = pack(MSG)
    monkeypatch.undo()
    assert struct.unpack("<q", old[4:12])[0] == then
    with pytest.raises(AuthError, match="old or ahead"):
        unpack(old, PullReply)


def test_secret_file_must_exist_and_be_long_enough(tmp_path):
    short, good = tmp_path / "short", tmp_path / "good"
    short.write_bytes(b"tooshort\n")
    good.write_bytes(b"0123456789abcdef0123\n")
    assert auth.read_secret_file(good) == b"0123456789abcdef0123"
    with pytest.raises(ValueError, match="at least 16"):
        auth.read_secret_file(short)
    with pytest.raises(ValueError, match="cannot read"):
        auth.read_secret_file(tmp_path / "missing")


def test_a_sealed_message_to_a_process_without_a_secret_says_so():
    auth.install(SECRET)
    sealed = pack(MSG)
    auth.install(None)
    with pytest.raises(AuthError, match="no auth secret"):
        unpack(sealed, PullReply)


def test_a_refusal_can_be_addressed_to_a_request_sealed_with_another_secret():
    from kvwire.connectors.control.framing import peek_request
    from kvwire.connectors.wire import PullRequest

    request = PullRequest(request_id="r1", transfer_id=7, consumer="c", transport_address=b"a", dst_block_ids=[1])
    auth.install(b"o" * 32)
    other = pack(request)
    auth.install(None)
    plain = pack(request)
    assert peek_request(other) == request and peek_request(plain) == request
    assert peek_request(b"KVA1" + b"\0" * 60) is None and peek_request(b"garbage") is None
