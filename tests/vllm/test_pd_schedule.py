"""One prefill and two decode vLLM servers (KvwireConnector over `auto`, every server kv_both) behind `kvwire router`
with its default flags.

Through the official `openai` client, two conversations of three turns each, interleaved: each conversation stays
on one decode server, the two use both, every turn after the first is decode-only (the decode server holds all but
its last few tokens: reason cached-on-decode), a short prompt goes decode-only (short-prompt), the headers say so,
and every answer equals a plain vLLM server's. The first decode server publishes its KV cache events
(`--kv-events-config`) and the router reads them (`--vllm-kv-events`): its prefix cache is known, the other's
predicted.

Then the same servers take tests/vllm/routed.py's checks over `auto` (`routed_equals_plain`): the prefill and the
second decode server, each of which may do either role, behind a router of their own that disaggregates every
request (two start-ups fewer than a pair of their own); every pull read the prefill process's KV cache itself
(path "cma"). Every server seals its control plane (`auth_secret_file`): a pull request forged from outside is
refused, counted on the prefill server's /metrics, and it serves on. The prefill and the second decode server export
their OpenTelemetry spans (`--otlp-traces-endpoint`, to tests/observability/otlp.py's receiver): a client's
`traceparent` passed on by the router makes each one's span of the request a child of the client's. Last, that
prefill server is restarted (a new epoch: its new process is read) and then SIGKILLed during a burst (every answer
still the plain server's, the decode server alive).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import subprocess
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx2
import pytest
import yaml
import zmq

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_cluster import VLLMServer, start_all
from kvwire.cluster.vllm_pd import (
    ALWAYS_DISAGGREGATE,
    PDCluster,
    counter_by_label,
    kvwire_pair,
    routed,
    start_router,
)
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from kvwire.connectors.vllm.tp import rank_key
from kvwire.connectors.wire import PullRequest, encode
from kvwire.observability.labels import DISAGGREGATED_REASONS
from kvwire.router.vllm.bodies import Endpoint
from kvwire.router.vllm.tokens import Ask, tokenize_body
from tests.observability.otlp import OTLPReceiver
from tests.vllm.conftest import PROMPTS
from tests.vllm.otlp import traced
from tests.vllm.routed import chat, complete, grown_since, openai_client, routed_equals_plain, stream

openai = pytest.importorskip("openai")

MAX_TOKENS = 16
SECRET = "trio-secret-of-sixteen-bytes-or-more"
TRACESTATE = "kvwire=test"
# long enough (about 600 tokens of the byte tokenizer) for the first turn to be disaggregated by default
SYSTEM = {"teacher": "You are a patient teacher of arithmetic and of nothing else. " * 10,
          "poet": "You are a poet who writes only about the sea, the wind and ships. " * 9}
USER = ["Tell me something.", "Go on, please.", "And what then?"]
STORE = (("VLLM_ENABLE_RESPONSES_API_STORE", "1"),)  # the Responses API keeps answers (store) for later turns
# a coding agent's servers: tools (auto tool choice), and the render endpoints the router renders its bodies by
AGENTS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-scale-out")
DRAIN_S = 30  # the prefill server's --shutdown-timeout: stopped, it serves the KV it holds until pulled


class Trio(NamedTuple):
    router_url: str
    prefill: VLLMServer
    decodes: list[VLLMServer]


@pytest.fixture(scope="module")
def spans() -> Iterator[OTLPReceiver]:
    """Where the prefill and the second decode server export their spans (up until both have stopped)."""
    with OTLPReceiver() as c:
        yield c


@pytest.fixture(scope="module")
def trio(vllm_model_dir: Path, redis_server: LocalRedis, spans: OTLPReceiver, tmp_path_factory) -> Iterator[Trio]:
    log_dir = tmp_path_factory.mktemp("schedule")
    secret = log_dir / "auth-secret"  # every server seals its control messages (the pairs' KV moves as before)
    secret.write_text(SECRET)
    # `auto` on one host: the decode servers read the prefill server's KV cache from its process (cma); kv_both: each
    # server may do either role, as the params say
    prefill, decode = (dataclasses.replace(s, kv_role="kv_both", auth_secret_file=secret, extra_env=STORE,
                                           extra_args=AGENTS)
                       for s in kvwire_pair(vllm_model_dir, redis_server.url, ConnectorKind.AUTO, log_dir))
    decode2 = traced(dataclasses.replace(decode, node_id="decode2-auto", log_path=log_dir / "decode2.log"),
                     spans.endpoint_for("decode2"))
    prefill = traced(dataclasses.replace(prefill, extra_args=(*AGENTS, "--shutdown-timeout", str(DRAIN_S))),
                     spans.endpoint_for("prefill"))
    events = f"ipc://{log_dir}/decode-kv-events"  # vLLM's publisher binds it (as `tcp://*:5557`), the router connects
    decode = dataclasses.replace(decode, extra_args=(*AGENTS, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events})))
    servers = start_all([prefill, decode, decode2])
    with routed(servers, [servers[0].url], [s.url for s in servers[1:]], log_dir / "router.log",
                ("--vllm-kv-events", f"{events},",  # the second decode server has none
                 "--log-level", "DEBUG")) as url:  # its placements, in the log; no flag of its policy
        yield Trio(url, servers[0], servers[1:])


class Turn(NamedTuple):
    decode: str
    path: str
    reason: str


def test_conversations_stay_where_their_kv_is_and_later_turns_are_decode_only(trio: Trio, plain_server: VLLMServer,
                                                                               vllm_model_dir: Path):
    model = str(vllm_model_dir)
    routed, plain = openai_client(trio.router_url), openai_client(plain_server.url)
    talks = {name: [{"role": "system", "content": text}] for name, text in SYSTEM.items()}
    turns: dict[str, list[Turn]] = {name: [] for name in talks}
    for user in USER:
        for name, messages in talks.items():  # interleaved: each turn of one between two of the other
            messages.append({"role": "user", "content": user})
            raw = routed.chat.completions.with_raw_response.create(model=model, messages=messages,
                                                                   max_tokens=MAX_TOKENS, temperature=0)
            text = raw.parse().choices[0].message.content or ""
            want = plain.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0).choices[0].message.content
            assert text == want, (name, len(turns[name]))
            turns[name].append(Turn(raw.headers["x-kvwire-decode"], raw.headers["x-kvwire-path"],
                                    raw.headers["x-kvwire-reason"]))
            messages.append({"role": "assistant", "content": text})
    for name, seen in turns.items():
        assert len({t.decode for t in seen}) == 1, f"{name} moved between decode servers: {seen}"
        assert seen[0].path == "disaggregated" and seen[0].reason in DISAGGREGATED_REASONS, seen
        assert all((t.path, t.reason) == ("decode-only", "cached-on-decode") for t in seen[1:]), seen
    assert {seen[0].decode for seen in turns.values()} == {s.url for s in trio.decodes}

    prompt = "Hello there, how are you?"
    raw = routed.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert (raw.headers["x-kvwire-path"], raw.headers["x-kvwire-reason"]) == ("decode-only", "short-prompt")
    assert raw.parse().choices[0].text == plain.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                                   temperature=0).choices[0].text
    metrics = httpx2.get(f"{trio.router_url}/metrics", timeout=10).text
    answered = dict(re.findall(r'^kvwire_requests_total\{status="([a-z]+)"\} (\S+)$', metrics, re.M))
    assert float(answered["ok"]) == 2 * len(USER) + 1, answered
    assert sum(float(n) for status, n in answered.items() if status != "ok") == 0, answered
    events = dict(re.findall(r'^kvwire_vllm_kv_events_total\{kind="([a-z]+)"\} (\S+)$', metrics, re.M))
    assert float(events["stored"]) > 0, events  # the first decode server's blocks, as its cache stored them


def test_responses_and_messages_apis_are_disaggregated_and_answers_found(trio: Trio, plain_server: VLLMServer,
                                                                        vllm_model_dir: Path):
    """OpenAI's Responses API and Anthropic's Messages API through the router (each company's official client),
    whole and streamed: disaggregated, each answer the plain server's, the router's count of their prompts' tokens
    vLLM's own. Answers stored on both decode servers are each found through the router (GET /v1/responses/{id}), and a
    later turn naming one goes decode-only to the server that stored it and answers as that server does."""
    model = str(vllm_model_dir)
    routed, plain = openai_client(trio.router_url), openai_client(plain_server.url)
    ask = {"model": model, "instructions": "Be brief.", "max_output_tokens": MAX_TOKENS, "temperature": 0}
    text = "Tell me of ships, harbours, tides and the lighthouses along the coast. " * 9  # > 512 tokens
    want = plain.responses.create(input=text, store=False, **ask).output_text
    raw = routed.responses.with_raw_response.create(input=text, **ask)
    assert (raw.headers["x-kvwire-path"], raw.parse().output_text) == ("disaggregated", want)
    counted = httpx2.post(f"{trio.decodes[0].url}/tokenize", json=_tokenize(Endpoint.RESPONSES, {
        "model": model, "input": text, "instructions": "Be brief."}), timeout=10).json()["count"]
    assert counted == raw.parse().usage.input_tokens
    with routed.responses.stream(input=text + " Streamed.", **ask) as events:
        streamed = events.get_final_response().output_text
    assert streamed == plain.responses.create(input=text + " Streamed.", store=False, **ask).output_text

    # Anthropic's official client; another system prompt: the same one would share the Responses requests' prefix
    anthropic = pytest.importorskip("anthropic")  # vLLM's dependency
    claude = anthropic.Anthropic(base_url=trio.router_url, api_key="unused", max_retries=0, timeout=120)
    message = {"model": model, "system": "Answer in one line.", "max_tokens": MAX_TOKENS,
               "messages": [{"role": "user", "content": text + " Anthropic."}]}
    greedy = {"temperature": 0}  # the client's newest version takes no `temperature` argument; vLLM reads it
    plain_got = httpx2.post(f"{plain_server.url}/v1/messages", json={**message, **greedy}, timeout=120).json()
    raw = claude.messages.with_raw_response.create(**message, extra_body=greedy)
    assert raw.headers["x-kvwire-path"] == "disaggregated", raw.headers["x-kvwire-reason"]
    got = raw.parse()
    assert got.content[0].text == plain_got["content"][0]["text"]
    # Anthropic's usage: input_tokens leaves out what was read from a cache (the pulled KV)
    assert got.usage.cache_read_input_tokens > 0, got.usage
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == claude.messages.count_tokens(
        model=model, system=message["system"], messages=message["messages"]).input_tokens == httpx2.post(
        f"{trio.decodes[0].url}/tokenize", json=_tokenize(Endpoint.MESSAGES, message), timeout=10).json()["count"]
    with claude.messages.stream(**message, extra_body=greedy) as events:
        assert "".join(events.text_stream) == plain_got["content"][0]["text"]

    # prompts that share no prefix with the ones above (which would keep them where those are): placed by load
    stored = [routed.responses.with_raw_response.create(input=f"Voyage {i}. {text}", **ask) for i in range(4)]
    homes = {r.parse().id: r.headers["x-kvwire-decode"] for r in stored}
    assert set(homes.values()) == {s.url for s in trio.decodes}, "answers stored on both decode servers"
    for rid, home in homes.items():
        found = httpx2.get(f"{trio.router_url}/v1/responses/{rid}", timeout=10)
        assert found.status_code == 200 and found.json()["id"] == rid and found.headers["x-kvwire-decode"] == home
        later = routed.responses.with_raw_response.create(input="Go on.", previous_response_id=rid, **ask)
        assert (later.headers["x-kvwire-path"], later.headers["x-kvwire-reason"], later.headers["x-kvwire-decode"]) \
            == ("decode-only", "previous-response", home)
        alone = openai_client(home).responses.create(input="Go on.", previous_response_id=rid, store=False, **ask)
        assert later.parse().output_text == alone.output_text


def _tokenize(endpoint: Endpoint, body: dict) -> dict:
    """What the router asks vLLM's /tokenize for a plain body's prompt."""
    ask = tokenize_body(endpoint, body)
    assert isinstance(ask, Ask) and ask.path == "/tokenize"
    return ask.body


def test_a_coding_agents_turns_are_rendered_and_stay_where_their_kv_is(trio: Trio, vllm_model_dir: Path):
    """A coding agent's Messages bodies (the system prompt in text blocks, tools, tool_use and tool_result blocks):
    the router has the decode servers render them (POST /v1/messages/render, served with --enable-scale-out), so
    the first turn is disaggregated, with the count vLLM's own, and the next, which adds a tool's result, goes
    decode-only to the server that holds the first turn's KV (cached-on-decode). Each answers as that server does
    when asked directly. Before, such bodies were placed by load and every turn disaggregated. Its cache_control
    markers move to the last block each turn, as Claude Code's do: they are no part of the prompt's cache scope."""
    body = {"model": str(vllm_model_dir), "max_tokens": MAX_TOKENS, "temperature": 0,
            "system": [{"type": "text", "text": "You are a coding agent working in a small repository. " * 12,
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "read_file", "description": "Read a file of the repository.",
                       "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What does notes.txt say?",
                                                       "cache_control": {"type": "ephemeral"}}]}]}
    first = httpx2.post(f"{trio.router_url}/v1/messages", json=body, timeout=120)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvwire-path"] == "disaggregated", first.headers["x-kvwire-reason"]
    home = first.headers["x-kvwire-decode"]
    rendered = httpx2.post(f"{home}/v1/messages/render", json=body, timeout=10).json()["token_ids"]
    usage = first.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(rendered)
    del body["messages"][0]["content"][0]["cache_control"]  # the marker moves to this turn's last block
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "notes.txt"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "Buy milk."}],
                                      "cache_control": {"type": "ephemeral"}}]}]
    second = httpx2.post(f"{trio.router_url}/v1/messages", json=body, timeout=120)
    assert (second.headers["x-kvwire-path"], second.headers["x-kvwire-reason"], second.headers["x-kvwire-decode"]) \
        == ("decode-only", "cached-on-decode", home)
    assert second.json()["content"] == httpx2.post(f"{home}/v1/messages", json=body, timeout=120).json()["content"]


def test_kv_both_servers_over_auto_equal_plain(trio: Trio, plain_server: VLLMServer, vllm_model_dir: Path,
                                               tmp_path: Path):
    url, router = start_router([trio.prefill.url], [trio.decodes[1].url], tmp_path / "router.log", ALWAYS_DISAGGREGATE)
    try:
        cluster = PDCluster(trio.prefill, trio.decodes[1], url, [router])
        before = cluster.kv_pulls_by_path()
        routed_equals_plain(cluster, plain_server, str(vllm_model_dir))
        paths = grown_since(before, cluster.kv_pulls_by_path())
        assert set(paths) == {"cma"}, f"one host: the KV is read from the prefill process itself, not {paths}"
        assert sum(cluster.kv_fallbacks().values()) == 0, cluster.kv_fallbacks()
    finally:
        router.terminate()
        router.wait(10)


def test_a_pull_forged_from_outside_is_refused_and_counted(trio: Trio, plain_server: VLLMServer, vllm_model_dir: Path,
                                                          redis_server: LocalRedis):
    """Every server of the trio seals its control plane (auth_secret_file): a pull request for a prompt the prefill
    server holds, sent unsealed to its side channel from a bare socket, gets a refusal; the prefill server counts it
    on its /metrics and serves on (a routed prompt still disaggregated and the plain server's)."""
    model = str(vllm_model_dir)
    prefill = openai_client(trio.prefill.url)
    held = prefill.completions.create(model=model, prompt=PROMPTS[2] + " Forged.", max_tokens=1,
                                      extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    rid = held.model_extra["kv_transfer_params"]["remote_request_id"]
    key = rank_key(rid, 0, 1)  # what the prefill server (TP=1) holds it under
    directory = KVDirectory(redis_server.url)
    try:
        entry = directory.wait_for(key, {TransferState.READY}, time.monotonic() + 10)
    finally:
        directory.close()
    assert entry is not None and entry.location is not None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(entry.location.side_channel)
        sock.send(encode(PullRequest(request_id=key, transfer_id=1, consumer="intruder",
                                     transport_address=b"x", dst_block_ids=list(entry.location.block_ids))))
        assert sock.poll(10_000), "the forged request got no answer"
        reply = sock.recv()
    finally:
        sock.close()
    assert reply.startswith(b"KVA1"), "the refusal is sealed: nothing the intruder can use"
    deadline = time.monotonic() + 10
    while _rejected(trio.prefill.url) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # vLLM takes connector stats with its next engine step's
    assert _rejected(trio.prefill.url) >= 1
    prompt = (PROMPTS[1] + " Still here. ") * 2  # past the router's --decode-only-below (512 tokens)
    want = openai_client(plain_server.url).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                              temperature=0).choices[0].text
    raw = openai_client(trio.router_url).completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert raw.parse().choices[0].text == want and raw.headers["x-kvwire-path"] == "disaggregated"


def _rejected(url: str) -> float:
    text = httpx2.get(f"{url}/metrics", timeout=10).text
    return sum(float(m[1]) for m in re.finditer(
        r'^vllm:kvwire_messages_rejected_total\{[^}]*reason="unauthenticated"[^}]*\} (\S+)$', text, re.M))


def test_a_clients_trace_context_reaches_the_prefill_and_the_decode_server(trio: Trio, spans: OTLPReceiver,
                                                                           plain_server: VLLMServer,
                                                                           vllm_model_dir: Path, tmp_path: Path):
    """Through a router of its own in front of the prefill and the second decode server, a client's request with a
    W3C `traceparent` and `tracestate`, whole (the router's first request: the decode step after the prefill step),
    streamed and as chat (the later path: both steps at once): each server exports one `llm_request` span in the
    client's trace, a child of the client's span (the router passes the header on unchanged and makes no span of its
    own), with the client's tracestate, naming the router's request id and the step's max_tokens; the router logs
    the trace id; every answer is disaggregated, pulled whole, and the plain server's."""
    model = str(vllm_model_dir)
    log = tmp_path / "router.log"
    url, router = start_router([trio.prefill.url], [trio.decodes[1].url], log, ALWAYS_DISAGGREGATE)
    try:
        routed, plain = openai_client(url), openai_client(plain_server.url)
        for n, (kind, ask) in enumerate({"whole": complete, "streamed": stream, "chat": chat}.items()):
            trace, parent = secrets.token_hex(16), secrets.token_hex(8)
            prompt = PROMPTS[n] + " Traced."
            answer = ask(routed, model, prompt, MAX_TOKENS, {"traceparent": f"00-{trace}-{parent}-01",
                                                             "tracestate": TRACESTATE})
            _spans_join_the_clients(spans, kind, answer.headers, trace, parent, answered=time.monotonic())
            assert answer.text == ask(plain, model, prompt, MAX_TOKENS).text, kind
            assert answer.cached_tokens == answer.prompt_tokens, "the decode server computed no prompt token"
            assert answer.headers["x-kvwire-path"] == "disaggregated", kind
            assert answer.headers["x-kvwire-reason"] == ("prefilled" if n == 0 else "prefilled-alongside"), kind
            assert f"request {answer.headers['x-request-id']}: trace {trace}" in log.read_text()
    finally:
        router.terminate()
        router.wait(10)


def _spans_join_the_clients(spans: OTLPReceiver, kind: str, headers: Mapping[str, str], trace: str, parent: str,
                            answered: float) -> None:
    """The prefill and the decode server each export one `llm_request` span of the request in the client's trace,
    its parent the client's span, with the client's tracestate, the router's request id and the step's max_tokens."""
    rid = headers["x-request-id"]
    got = spans.of_trace(trace, {"prefill", "decode2"}, timeout_s=30)
    print(f"{kind} ({headers['x-kvwire-reason']}), trace {trace}, router's request {rid}: "
          f"{[(s.source, s.name, s.parent_span_id, s.attributes.get('gen_ai.request.id')) for s in got]} "
          f"{time.monotonic() - answered:.1f} s after the answer")
    assert sorted((s.source, s.name) for s in got) == [("decode2", "llm_request"), ("prefill", "llm_request")], got
    by_source = {s.source: s for s in got}
    for source, max_tokens in (("prefill", 1), ("decode2", MAX_TOKENS)):
        span = by_source[source]
        assert span.parent_span_id == parent and span.trace_state == TRACESTATE, span
        assert rid in str(span.attributes["gen_ai.request.id"]), span  # vLLM's id: the router's, prefixed
        assert span.attributes["gen_ai.request.max_tokens"] == max_tokens, span


def test_a_real_prometheus_reads_the_dashboards_vllm_panels(trio: Trio, vllm_model_dir: Path, tmp_path: Path):
    """deploy/observability's dashboard as an operator's Prometheus runs it, against real vLLM servers with kvwire's
    connector (the `component` labels its PodMonitor sets): the two vLLM-connector panels' queries return series
    (KV pulled per second, a series per decode server that pulled; failed pulls by reason, every reason counted
    from zero), and every alert's expression evaluates. tests/integration/test_observability.py checks the rest."""
    from tests.observability.prometheus import DASHBOARD, RULES, Prometheus

    targets = [("vllm-prefill", trio.prefill.url.removeprefix("http://"))] + [
        ("vllm-decode", d.url.removeprefix("http://")) for d in trio.decodes]
    panels = [(p["title"], t["expr"]) for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]
              if "vllm:" in t["expr"]]
    assert len(panels) == 2, panels
    prometheus = Prometheus(tmp_path, targets)
    client = openai_client(trio.router_url)
    try:
        prometheus.wait_ready()
        rate = next(expr for _, expr in panels if "pull_bytes" in expr)
        deadline, empty, pulled = time.monotonic() + 60, panels, []
        while (empty or not any(float(r["value"][1]) > 0 for r in pulled)) and time.monotonic() < deadline:
            # new and long enough to be disaggregated (a short or cached prompt goes decode-only); rate() needs two
            # scrapes after the pull
            complete(client, str(vllm_model_dir), f"Scraped {secrets.token_hex(300)}.", max_tokens=2)
            empty = [(title, expr) for title, expr in panels if not prometheus.query(expr)]
            pulled = prometheus.query(rate)
            time.sleep(1)
        assert not empty, f"vLLM panels with no series: {empty}"
        print(f"\nPrometheus, vLLM panels: {[(r['metric'], r['value'][1]) for r in pulled]}")
        assert any(float(r["value"][1]) > 0 for r in pulled), "no KV pulled per second"
        for rule in yaml.safe_load(RULES.read_text())["spec"]["groups"][0]["rules"]:
            prometheus.query(rule["expr"])  # evaluates (HTTP 200), firing or not
        up = sorted((r["metric"]["component"], r["value"][1]) for r in prometheus.query('up{component=~"vllm-.*"}'))
        assert up == [("vllm-decode", "1"), ("vllm-decode", "1"), ("vllm-prefill", "1")], up
    finally:
        prometheus.stop()


def test_a_stopped_prefill_serves_its_held_kv_then_a_restart_is_read_anew_and_a_killed_one_recomputed(
        trio: Trio, plain_server: VLLMServer, vllm_model_dir: Path, tmp_path: Path):
    """The prefill server stopped (SIGTERM, --shutdown-timeout) while it holds a prompt's KV: a decode server
    pulls it, and the server then exits, before its timeout. Restarted under its id (a new epoch): the decode
    server reads the new process's KV cache (its old one dropped with the dead process's socket). Then that one
    SIGKILLed while a burst's KV is being pulled: every answer is the plain server's (recomputed where the KV
    could not come), the decode server lives on, and nothing it pulled was read from the dead process after its
    death (the answers say so)."""
    model, decode = str(vllm_model_dir), trio.decodes[1]
    plain = openai_client(plain_server.url)
    prompts = [p + f" Restart {i}." for i in range(2) for p in PROMPTS]
    want = {p: plain.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in prompts}
    _stopped_while_holding(trio.prefill, decode, model, prompts[0], want[prompts[0]])
    restarted = VLLMServer(dataclasses.replace(trio.prefill.spec, port=trio.prefill.port)).start()
    router: subprocess.Popen | None = None
    try:
        restarted.wait_ready()
        url, router = start_router([restarted.url], [decode.url], tmp_path / "router.log", ALWAYS_DISAGGREGATE)
        cluster = PDCluster(restarted, decode, url, [router])
        routed = openai_client(url)
        before, failed = cluster.kv_pulls_by_path(), sum(cluster.kv_failed_by_reason().values())
        for prompt in prompts[:len(PROMPTS)]:
            got = routed.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == want[prompt]
        assert grown_since(before, cluster.kv_pulls_by_path()) == {"cma": len(PROMPTS)}
        assert sum(cluster.kv_failed_by_reason().values()) == failed
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            burst = {p: pool.submit(routed.completions.create, model=model, prompt=p, max_tokens=MAX_TOKENS,
                                    temperature=0) for p in prompts[len(PROMPTS):]}
            time.sleep(0.3)  # some of them are on the prefill server, or being pulled, now
            restarted.kill()
            got_burst = {p: f.result(timeout=120).choices[0].text for p, f in burst.items()}
        assert got_burst == {p: want[p] for p in burst}
        assert httpx2.get(f"{decode.url}/health", timeout=10).status_code == 200
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        restarted.stop()


def _stopped_while_holding(prefill: VLLMServer, decode: VLLMServer, model: str, prompt: str, want: str) -> None:
    """`prefill` computes `prompt` for a decode server and is stopped (SIGTERM) before `decode` asks for it:
    `decode` pulls every prompt token from the stopping server, and it exits once that is done."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    params = httpx2.post(f"{prefill.url}/v1/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    assert prefill.proc is not None
    before = counter_by_label(decode.url, "vllm:prompt_tokens_by_source_total", "source")
    stopped = time.monotonic()
    prefill.proc.terminate()
    _until_logged(prefill, "[shutdown] API server: shutdown triggered")  # it is stopping: asked only now
    answer = openai_client(decode.url).completions.create(**body, extra_body={"kv_transfer_params": params})
    assert answer.choices[0].text == want
    after = counter_by_label(decode.url, "vllm:prompt_tokens_by_source_total", "source")
    grown = {source: n - before.get(source, 0) for source, n in after.items()}
    # the decode server's prefix cache may hold the prompt's first blocks (earlier prompts share them): the rest
    assert grown["external_kv_transfer"] > 0 and grown["local_compute"] == 0, grown
    assert grown["external_kv_transfer"] + grown["local_cache_hit"] == answer.usage.prompt_tokens, grown
    assert prefill.proc.wait(DRAIN_S + 10) == 0
    assert time.monotonic() - stopped < DRAIN_S, "it left once its held KV was pulled, not at its timeout"


def _until_logged(server: VLLMServer, line: str, timeout_s: float = 30.0) -> None:
    assert server.spec.log_path is not None
    deadline = time.monotonic() + timeout_s
    while line not in server.spec.log_path.read_text():
        assert time.monotonic() < deadline, f"{line!r} not in {server.spec.log_path}"
        time.sleep(0.05)  # another process's log: polled
