"""Malformed control messages on the nodes' real sockets, and malformed HTTP bodies at the router.

The barrage (seeded, so a failure replays) goes to the prefill and decode nodes' zmq
work sockets and to the prefill node's transfer-server side channel: random bytes,
truncated encodings of valid messages, valid msgpack with wrong types, unknown tags,
wrong wire versions, absurd lengths, valid messages of the wrong kind, and pulls whose
block list or transport address does not match. Afterwards the nodes must be alive,
have logged the rejections, and serve a normal request exactly, with full pools and
a clean directory.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import httpx2
import msgspec
import pytest
import zmq

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from kvwire.connectors.wire import (
    WIRE_VERSION,
    DType,
    KVLayout,
    KVLocation,
    KVReady,
    PullReply,
    PullRequest,
    decode,
    encode,
)
from kvwire.protocol.work import DecodeWork, PrefillWork, SamplingParams, TokenChunk, WorkError
from tests.faults.harness import (
    REQUEST_TIMEOUT_S,
    SLACK_S,
    body_for,
    is_openai_error,
    judge,
    metric,
    post,
    wait_recovered,
    wait_until,
)
from tests.faults.test_node_faults import reference

pytestmark = pytest.mark.slow

PER_TARGET = 800  # three targets: 2,400 messages
SEED = 20240605
_enc = msgspec.msgpack.encode


def _junk_value(rng: random.Random):
    return rng.choice([None, True, -1, 2**63, 2**64 - 1, -(2**63), 1.5, float("inf"), "", "x" * rng.randint(1, 300),
                       b"\x00\xff", [], [1, "a", None], {"k": [1]}, {"type": "prefill"}, list(range(50))])


def _templates(reply_to: str, consumer_address: bytes, held_rid: str) -> list:
    """Valid messages of every kind, as plain data (msgspec builtins) ready to be bent out of shape."""
    msgs = [
        PrefillWork(request_id="fuzz-p", prompt_token_ids=[1, 2, 3]),
        DecodeWork(request_id="fuzz-d", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2),
                   prefill_node="", reply_to=reply_to),
        PullRequest(request_id=held_rid, transfer_id=7, consumer="decode-0", transport_address=consumer_address,
                    dst_block_ids=[0]),
        PullReply(request_id="x", transfer_id=1, ok=True),
        TokenChunk(request_id="x", token_ids=[1]),
        WorkError(request_id="x", node="n", reason="r"),
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype=DType.FLOAT32),
        KVReady(location=KVLocation(  # well formed or not, for a request nobody expects: ignored
            request_id="fuzz-r", producer="prefill-0", producer_epoch=1, kind=ConnectorKind.TCP,
            side_channel="tcp://127.0.0.1:1", transport_address=b"127.0.0.1:2",
            layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype=DType.FLOAT32),
            block_ids=[0], num_tokens=1, hidden=[])),
    ]
    return [[WIRE_VERSION, msgspec.to_builtins(m)] for m in msgs]


def malformed(rng: random.Random, templates: list) -> bytes | list[bytes]:
    """One malformed message (a list: several frames where one is expected)."""
    tmpl = json.loads(json.dumps(rng.choice(templates), default=lambda b: b.hex()))  # a deep copy
    body = tmpl[1]
    kind = rng.randrange(9)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randint(0, 600))
    if kind == 1:  # a valid message cut short
        data = _enc(rng.choice(templates))
        return data[: rng.randint(0, len(data) - 1)]
    if kind == 2:  # valid msgpack, a field of the wrong type
        body[rng.choice([k for k in body if k != "type"])] = _junk_value(rng)
        return _enc(tmpl)
    if kind == 3:  # an unknown tag
        body["type"] = rng.choice(["bogus", "", "PREFILL", "__class__", 7, None])
        return _enc(tmpl)
    if kind == 4:  # a wrong wire version
        tmpl[0] = rng.choice([0, WIRE_VERSION + 1, -1, 2**40, "1", None, 1.0])
        return _enc(tmpl)
    if kind == 5:  # absurd lengths: headers promising more than is sent
        return rng.choice([b"\xdd\xff\xff\xff\xff", b"\x92\x01\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xf0abc",
                           b"\xc6\x7f\xff\xff\xff" + b"\x00" * 10])
    if kind == 6:  # huge lists
        huge = [rng.randint(-5, 10**9)] * rng.choice([10**4, 10**5])  # before the key: the seeded draws' order
        body[rng.choice(["prompt_token_ids", "dst_block_ids", "token_ids", "block_ids"])] = huge
        return _enc(tmpl)
    if kind == 7:  # not an envelope at all
        return _enc(rng.choice([body, [], [WIRE_VERSION], [WIRE_VERSION, body, "extra"], {"version": 1, "body": body},
                                5]))
    return [_enc(rng.choice(templates)), b"second frame"]  # several frames


def _send(sock: zmq.Socket, msg) -> None:
    if isinstance(msg, list):
        sock.send_multipart(msg)
    else:
        sock.send(msg)


def _log_lines(cluster, role: str, pattern: str) -> list[str]:
    path = Path(cluster.spec.log_dir) / f"{role}.log"
    return [line for line in path.read_text(errors="replace").splitlines() if re.search(pattern, line)]


def _hold_one_request(cluster, directory: KVDirectory, prefill_address: str, ctx: zmq.Context, rid: str):
    """Have the prefill node compute and hold a request nobody will pull; return its KVLocation."""
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(prefill_address)
    push.send(encode(PrefillWork(request_id=rid, prompt_token_ids=list(range(40)))))
    push.close()
    assert wait_until(lambda: (e := directory.get(rid)) is not None and e.location is not None, 20)
    return directory.get(rid).location


def test_malformed_control_messages_are_rejected_and_nodes_keep_serving(cluster, tiny_model_dir, tally):
    rng = random.Random(SEED)
    ctx = zmq.Context.instance()
    directory = KVDirectory(cluster.redis_url)
    nodes = {n.role.value: n for n in directory.live_nodes()}
    consumer_address = directory.transport_address_of("decode-0", ConnectorKind.TCP)
    assert consumer_address, "the decode node publishes its TCP address"
    replies = ctx.socket(zmq.PULL)  # where the decode node answers the work it refuses
    reply_to = f"tcp://127.0.0.1:{replies.bind_to_random_port('tcp://127.0.0.1')}"
    loc = _hold_one_request(cluster, directory, nodes["prefill"].work_endpoint, ctx, "fuzz-held")
    templates = _templates(reply_to, consumer_address, "fuzz-held")
    before = {r: metric(cluster.ops_urls[r], "kvwire_messages_rejected_total", reason="malformed") or 0.0
              for r in ("prefill", "decode")}

    assert nodes["decode"].kv_ready_endpoint, "the decode node publishes its consumer's KVReady inbox"
    targets = [nodes["prefill"].work_endpoint, nodes["decode"].work_endpoint, nodes["decode"].kv_ready_endpoint]
    for endpoint in targets:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(endpoint)
        for _ in range(PER_TARGET):
            _send(push, malformed(rng, templates))
        push.close()
    side = ctx.socket(zmq.DEALER)
    side.setsockopt(zmq.LINGER, 0)
    side.connect(loc.side_channel)
    for _ in range(PER_TARGET):
        _send(side, malformed(rng, templates))
    # Pulls that decode but must be refused: a forged transport address, a block list of the wrong length.
    forged = [PullRequest(request_id="fuzz-held", transfer_id=100, consumer="decode-0", transport_address=b"forged",
                          dst_block_ids=[0] * len(loc.block_ids)),
              PullRequest(request_id="fuzz-held", transfer_id=101, consumer="decode-0",
                          transport_address=consumer_address, dst_block_ids=list(range(len(loc.block_ids) + 5))),
              PullRequest(request_id="no-such-request", transfer_id=102, consumer="decode-0",
                          transport_address=consumer_address, dst_block_ids=[1])]
    for msg in forged:
        side.send(encode(msg))
    tally.malformed += (len(targets) + 1) * PER_TARGET + len(forged)

    refused = {}
    deadline = time.monotonic() + 20
    while len(refused) < len(forged) and time.monotonic() < deadline:
        if side.poll(500):
            reply = decode(side.recv(), expect=PullReply)
            refused[reply.transfer_id] = reply
    side.close()
    assert {100, 101, 102} <= set(refused) and not any(r.ok for r in refused.values()), refused

    def all_rejected() -> bool:  # every work-socket message is read and refused, then the count stops
        now = {r: metric(cluster.ops_urls[r], "kvwire_messages_rejected_total", reason="malformed") or 0.0
               for r in before}
        return all(now[r] - before[r] >= PER_TARGET * 0.5 for r in before)

    assert wait_until(all_rejected, 60, 0.5)
    assert all(p.poll() is None for p in cluster.procs.values()), "a node died of a malformed message"
    answered = 0
    while replies.poll(200):
        assert isinstance(decode(replies.recv(), expect=(WorkError, TokenChunk)), (WorkError, TokenChunk))
        answered += 1
    replies.close()
    directory.close()
    side_rejections = _log_lines(cluster, "prefill", r"side channel: rejected message from peer \S+")
    work_rejections = {r: _log_lines(cluster, r, "rejected a message on the work socket") for r in before}
    inbox_rejections = _log_lines(cluster, "decode", "rejected a message on its KVReady inbox")
    print(f"\n{tally.malformed} malformed messages; side-channel rejections logged {len(side_rejections)}, "
          f"work-socket rejections logged {({r: len(v) for r, v in work_rejections.items()})}, "
          f"KVReady-inbox rejections logged {len(inbox_rejections)}, {answered} answers to reply_to")
    assert len(side_rejections) >= PER_TARGET * 0.5 and len(inbox_rejections) >= PER_TARGET * 0.5
    assert all(len(v) >= PER_TARGET * 0.5 for v in work_rejections.values())

    prompt = [ord(c) for c in "after the barrage"]
    out = post(cluster.url, body_for(prompt, 8), REQUEST_TIMEOUT_S + SLACK_S)
    judge([out], reference(tiny_model_dir, [prompt], 8), tally, deadline_s=REQUEST_TIMEOUT_S, require_bypass=True)
    assert tally.completed == 1, out
    left = wait_recovered(cluster, timeout_s=5.0)
    tally.leaked_blocks += left.leaked_blocks
    # fuzz-held (its pull was refused to a forger, so it stays held) expires after its hold deadline;
    # its EXPIRED entry may remain until its TTL; nothing else may.
    assert left.leaked_blocks == 0 and all(o.startswith("fuzz-held:") for o in left.orphans), left


def test_refused_pull_leaves_no_ready_entry(cluster):
    directory = KVDirectory(cluster.redis_url)
    try:
        entry = directory.get("fuzz-held")
        assert entry is None or entry.state != TransferState.READY, entry
    finally:
        directory.close()


def test_work_socket_rejections_name_the_peer(cluster):
    lines = _log_lines(cluster, "decode", "rejected a message on the work socket")
    assert lines and all("127.0.0.1" in line or "peer" in line for line in lines)


# --- HTTP ------------------------------------------------------------------------------------------

BAD_BODIES = [
    (b"", None), (b"null", None), (b"[]", None), (b'"prompt"', None), (b"{", None), (b"\xff\xfe{}", None),
    (b"[" * 100_000 + b"]" * 100_000, None),  # nesting deep enough to exhaust the decoder's recursion
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), None),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), None),
    (json.dumps({"prompt": "x", "max_tokens": 1.5}).encode(), None),
    (json.dumps({"prompt": "x", "max_tokens": True}).encode(), None),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 2**70}).encode(), None),
    (json.dumps({"prompt": "x", "seed": -1}).encode(), "seed"),
    (json.dumps({"prompt": "x", "seed": 2**70}).encode(), None),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature"),
    (b'{"prompt": "x", "temperature": 1e999}', None),
    (json.dumps({"prompt": "x", "n": 0}).encode(), "n"),
    (json.dumps({"prompt": "x", "n": 129}).encode(), "n"),
    (json.dumps({"prompt": "x", "zzz": 1}).encode(), "zzz"),  # unknown fields are named, never dropped
    (json.dumps({"prompt": "x", "stop": [""]}).encode(), "stop"),
    (json.dumps({"prompt": ["a", [1]]}).encode(), "prompt"),
    (json.dumps({"prompt": {"text": "x"}}).encode(), None),
    (json.dumps({"prompt": [1, "a"]}).encode(), None),
    (json.dumps({"prompt": [-1, 2]}).encode(), "prompt"),
    (json.dumps({"prompt": []}).encode(), "prompt"),
    (json.dumps({"prompt": list(range(256)) * 17}).encode(), "prompt"),  # 4,352 tokens > the 4,096 context
    (json.dumps({"prompt": "x" * 4000, "max_tokens": 200}).encode(), "prompt"),  # fits alone, not with its output
    (b'{"prompt": "\\ud800"}', None),  # a lone surrogate: no UTF-8 encoding exists
    (b'{"prompt": "x", "max_tokens": 2, "max_tokens": "twice"}', None),
]


def _is_400(resp: httpx2.Response, param: str | None) -> bool:
    body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else None
    return resp.status_code == 400 and is_openai_error(body) and (param is None or body["error"]["param"] == param)


@pytest.mark.parametrize("body, param", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_http_bodies_get_400_in_openai_shape(cluster, body, param):
    resp = httpx2.post(f"{cluster.url}/v1/completions", content=body, headers={"content-type": "application/json"},
                      timeout=REQUEST_TIMEOUT_S + SLACK_S)
    assert _is_400(resp, param), (resp.status_code, resp.text[:300])


def _random_json(rng: random.Random, depth: int = 0):
    leaves = [None, True, False, 0, -1, 1, 2, 3, 2**31, 2**64, -(2**70), 0.5, -0.0, 1e308, "", "x", "héllo",
              "\u0000", "a" * 50]
    if depth > 3 or rng.random() < 0.4:
        return rng.choice(leaves)
    if rng.random() < 0.5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "n", "model", "return_token_ids", "zzz"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))}


def _cheap(obj) -> object:
    """Keep the valid bodies quick to serve: small max_tokens, no streaming left open."""
    if isinstance(obj, dict):
        max_tokens = obj.get("max_tokens")
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 4 < max_tokens < 5000:
            obj["max_tokens"] = 3
        obj.setdefault("max_tokens", 2)
    return obj


def test_random_json_bodies_never_get_5xx(cluster, tally):
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    client = httpx2.Client(base_url=cluster.url, timeout=REQUEST_TIMEOUT_S + SLACK_S)  # one connection, as clients do
    for _ in range(300):
        body = json.dumps(_cheap(_random_json(rng))).encode()
        resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (body[:300], resp.status_code, resp.text[:300])
        if resp.status_code == 404:  # a "model" the router does not serve
            assert resp.json()["error"]["code"] == "model_not_found", resp.text[:300]
        elif resp.status_code != 200:
            assert _is_400(resp, None), (body[:300], resp.text[:300])
    client.close()
    tally.malformed += 300
    print(f"\nrandom JSON bodies by status: {statuses}")
