"""The official `openai` client against a real cluster (redis-server, prefill and decode nodes, router; KV
over TCP): completions and chat, whole and streamed, and every sampling parameter, each answer equal, token
for token and logprob for logprob, to the single-process engine on the same prompt."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.connectors.config import ConnectorKind
from kvwire.engine.reference import generate_with_logprobs
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import wait_pools_full_and_directory_empty
from tests.observability.otlp import OTLPReceiver, otel_missing
from tests.procs import FORK

pytestmark = pytest.mark.slow
PROMPT = list(b"The quick brown fox jumps over the lazy dog")
OTHER = list(b"Disaggregated serving, ")
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("openai") / "tiny"
    subprocess.run([sys.executable, "-m", "kvwire.cli.main", "init-model", str(path), "--hf-tokenizer"], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver | None]:
    """A real OTLP/HTTP receiver the cluster's processes export their spans to (None without the otel extra)."""
    if otel_missing():
        yield None
        return
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory, receiver: OTLPReceiver | None):
    spec = ClusterSpec(model_dir=model_dir, connector=ConnectorKind.TCP, served_model_names=(MODEL, "alias"),
                       log_dir=tmp_path_factory.mktemp("openai-logs"), launch=FORK,
                       traces_endpoint=receiver.endpoint if receiver else "")
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def _reference(model_dir: Path, prompt: list[int], **params):
    return generate_with_logprobs(model_dir, [prompt], SamplingParams(**params))[0]


VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens")
CASES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11},
    "penalties": {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    "ignore_eos": {"temperature": 0.0, "ignore_eos": True},
    "seeded": {"temperature": 1.0, "seed": 2**40},
}


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_equal_the_single_process_engine(client, model_dir, case):
    params = CASES[case]
    extra = {k: v for k, v in params.items() if k in VLLM_EXTRAS}
    openai_params = {k: v for k, v in params.items() if k not in VLLM_EXTRAS}
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=3, **openai_params,
                                    extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, **extra})
    want_ids, want_lps = _reference(model_dir, PROMPT, max_tokens=16, logprobs=3, **params)
    choice = got.choices[0]
    assert choice.token_ids == want_ids
    assert choice.logprobs.token_logprobs == [lp.logprob for lp in want_lps]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in want_ids]
    # the sampled token's entry comes first, as OpenAI's and vLLM's do: up to logprobs + 1 of them
    assert choice.logprobs.top_logprobs == [{f"token_id:{t}": lp.logprob,
                                             **{f"token_id:{i}": v for i, v in zip(lp.top_ids, lp.top_logprobs)}}
                                            for t, lp in zip(want_ids, want_lps, strict=True)]
    assert got.model_extra["kvwire"]["bypassed"] is True  # the prompt's KV came from the prefill node
    assert got.usage.completion_tokens == len(want_ids) and got.usage.prompt_tokens == len(PROMPT)


def test_stop_token_ids_and_min_tokens(client, model_dir):
    greedy = _reference(model_dir, PROMPT, max_tokens=16)[0]
    stop_id = greedy[6]
    first = greedy.index(stop_id)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "return_token_ids": True})
    assert got.choices[0].token_ids == greedy[:first + 1] and got.choices[0].finish_reason == "stop"
    later = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={
        "stop_token_ids": [stop_id], "min_tokens": first + 2, "return_token_ids": True})
    want = _reference(model_dir, PROMPT, max_tokens=16, stop_token_ids=[stop_id], min_tokens=first + 2)[0]
    assert later.choices[0].token_ids == want and stop_id not in want[:first + 2]


def test_stop_strings_whole_and_streamed(client, cluster):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[9:12]
    cut = full[:full.index(stop)]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0, stop=[stop, "@@"],
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 40  # the rest was cancelled, not generated
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
    assert all(free == total for free, total in pools.values()) and leftover == [], pools


def test_n_best_of_and_batched_prompts(client, model_dir):
    got = client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], max_tokens=6, temperature=1.0, n=2, seed=5,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for c in got.choices:  # prompt c.index // 2, choice j = c.index % 2 sampled with seed 5 + j
        prompt = [PROMPT, OTHER][c.index // 2]
        assert c.token_ids == _reference(model_dir, prompt, max_tokens=6, temperature=1.0, seed=5 + c.index % 2)[0]
    # each prompt prefilled and moved once: its later choice started from that KV on the same decode node
    reports = got.model_extra["kvwire"]["choices"]  # type: ignore[index]
    assert [(r["reason"], r["bypassed"], r["kv_bytes"] > 0) for r in reports] == \
        [("prefilled", True, True), ("prompt-shared", True, False)] * 2
    assert reports[1]["decode_node"] == reports[0]["decode_node"]
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=1, best_of=3,
                                     seed=5, extra_body={"return_token_ids": True})
    runs = [_reference(model_dir, PROMPT, max_tokens=6, temperature=1.0, seed=5 + j, logprobs=0) for j in range(3)]
    winner = max(runs, key=lambda r: sum(lp.logprob for lp in r[1]))
    assert best.choices[0].token_ids == winner[0] and best.choices[0].logprobs is None


def test_chat_whole_streamed_and_equal_to_its_rendered_prompt(client, cluster, model_dir):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model="alias", messages=messages, max_completion_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 8
    assert len(whole.choices[0].logprobs.content) == 8
    assert all(len(e.top_logprobs) == 2 for e in whole.choices[0].logprobs.content)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 8
    rendered = "<|system|>\nYou are terse.\n<|user|>\nSay hi\n<|assistant|>\n"
    assert whole.usage.prompt_tokens == len(rendered.encode())
    want = _reference(model_dir, list(rendered.encode()), max_tokens=8, logprobs=2)
    assert [e.logprob for e in whole.choices[0].logprobs.content] == [lp.logprob for lp in want[1]]


def test_responses_api_whole_and_streamed_equal_chat(client, model_dir):
    """OpenAI's Responses API (the official client's `responses`): the chat request it stands for, disaggregated,
    its text the single-process engine's; streamed through the client's own helper; what it does not do refused."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    whole = client.responses.create(model=MODEL, instructions="You are terse.", input="Say hi", max_output_tokens=8,
                                    temperature=0)
    rendered = list(b"<|system|>\nYou are terse.\n<|user|>\nSay hi\n<|assistant|>\n")
    want = _reference(model_dir, rendered, max_tokens=8, temperature=0.0)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.usage.input_tokens == len(rendered)
    assert (whole.status, whole.incomplete_details.reason, whole.usage.output_tokens) == (
        "incomplete", "max_output_tokens", len(want))
    report = whole.model_extra["kvwire"]
    assert (report["path"], report["bypassed"]) == ("disaggregated", True)
    with client.responses.stream(model=MODEL, instructions="You are terse.", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}], max_output_tokens=8,
            temperature=0) as events:
        kinds = [e.type for e in events]
        final = events.get_final_response()
    assert final.output_text == whole.output_text and final.id.startswith("resp_")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    for refused in ({"store": True}, {"previous_response_id": "resp_1"}, {"include": ["reasoning.encrypted_content"]}):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="hi", **refused)
        assert err.value.body["param"] == next(iter(refused))


def test_anthropic_messages_whole_streamed_and_counted(cluster, client, model_dir):
    """Anthropic's Messages API through the official `anthropic` client: the chat request it stands for,
    disaggregated, its text the same chat answer's; streamed through the client's own helper; a stop sequence
    named as it ended the answer; count_tokens the rendered prompt's length; a refusal in Anthropic's shape."""
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say hi"}]
    whole = claude.messages.create(model=MODEL, max_tokens=8, system="You are terse.", messages=messages,
                                   extra_body={"temperature": 0})
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                          messages=[{"role": "system", "content": "You are terse."}, *messages])
    text = chat.choices[0].message.content
    rendered = len(b"<|system|>\nYou are terse.\n<|user|>\nSay hi\n<|assistant|>\n")
    assert (whole.content[0].text, whole.stop_reason, whole.usage.output_tokens) == (text, "max_tokens", 8)
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == rendered
    assert (whole.model_extra["kvwire"]["path"], whole.model_extra["kvwire"]["bypassed"]) == ("disaggregated", True)
    cut = next(k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k)  # a stop first seen there
    stop = text[cut:cut + 2]
    with claude.messages.stream(model=MODEL, max_tokens=8, system="You are terse.", messages=messages,
                                extra_body={"temperature": 0}, stop_sequences=[stop]) as events:
        final = events.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (text[:cut], "stop_sequence", stop)
    counted = claude.messages.count_tokens(model=MODEL, system="You are terse.", messages=messages)
    assert counted.input_tokens == rendered
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=8, messages=messages,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert err.value.body["error"] == {"type": "invalid_request_error", "message": "extended thinking is not supported"}


def test_echo_and_refusals(client):
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Hello") and len(echoed.choices[0].text.encode()) >= 5
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="bogus_param"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"bogus_param": 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"5": 1.0})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


def test_a_client_that_leaves_mid_stream_cancels_its_request(client, cluster):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx2.get(f"{cluster.url}/metrics").text
        if 'kvwire_requests_total{status="cancelled"} 1.0' in metrics:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the router never counted the stream as cancelled")
    pools, leftover = wait_pools_full_and_directory_empty(cluster.redis_url)
    assert all(free == total for free, total in pools.values()) and leftover == [], pools


def test_chat_messages_that_need_tools_or_images_are_refused(client):
    for message, match in [({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "text"),
                           ({"role": "tool", "content": "x", "tool_call_id": "1"}, "tool"),
                           ({"role": "user", "content": "x", "bogus": 1}, "bogus")]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model=MODEL, messages=[message], max_tokens=2)


def test_tokenize_and_detokenize(cluster):
    got = httpx2.post(f"{cluster.url}/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()
    assert got["tokens"] == [72, 105] and got["count"] == 2 and got["max_model_len"] > 0
    chat = httpx2.post(f"{cluster.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert bytes(chat["tokens"]).decode() == "<|user|>\nHi\n<|assistant|>\n"
    assert httpx2.post(f"{cluster.url}/detokenize", json={"tokens": [72, 105]}).json() == {"prompt": "Hi"}
    assert httpx2.post(f"{cluster.url}/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert httpx2.post(f"{cluster.url}/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_a_clients_trace_reaches_the_nodes_and_their_spans_join_it(cluster, client, receiver):
    """A client's W3C traceparent (sent by the official client as a header) goes through the router to both
    nodes: each logs the trace id, and each exports its span (OTLP/HTTP, to a real receiver) in the client's
    trace: the router's "kvwire.route" a child of the client's span, the nodes' children of the router's, the
    decode span with the transfer's bytes and duration."""
    if receiver is None:
        pytest.skip(f"no spans here: {otel_missing()}")
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "trace me"}],
                                         max_tokens=4, temperature=0,
                                         extra_headers={"traceparent": f"00-{trace}-{parent}-01",
                                                        "tracestate": "vendor=kvwire-test"})
    assert out.choices[0].finish_reason in ("stop", "length")
    spans = receiver.wait_for(trace, {"kvwire.route", "kvwire.prefill", "kvwire.decode"}, timeout_s=30)
    assert set(spans) == {"kvwire.route", "kvwire.prefill", "kvwire.decode"}, spans
    route, prefill, decode = spans["kvwire.route"], spans["kvwire.prefill"], spans["kvwire.decode"]
    assert (route.service, prefill.service, decode.service) == ("kvwire-router", "kvwire-prefill", "kvwire-decode")
    assert route.parent_span_id == parent
    assert prefill.parent_span_id == route.span_id and decode.parent_span_id == route.span_id
    assert decode.attributes["kvwire.bypassed"] is True and decode.attributes["kvwire.kv_bytes"] > 0
    assert decode.attributes["kvwire.transfer_ms"] > 0 and decode.attributes["kvwire.transport"] == "tcp"
    assert route.attributes["kvwire.kv_bytes"] == decode.attributes["kvwire.kv_bytes"]
    assert route.attributes["kvwire.path"] == "disaggregated" and not any(s.error for s in spans.values())
    assert route.start_ns <= prefill.start_ns and decode.end_ns <= route.end_ns
    for role in ("router", "prefill", "decode"):
        log = (Path(cluster.spec.log_dir) / f"{role}.log").read_text(errors="replace")
        assert re.search(rf"request \S+: trace {trace}", log), f"{role} did not log the trace id"
    print(f"\nspans of trace {trace}: route {(route.end_ns - route.start_ns) / 1e6:.1f} ms, prefill "
          f"{(prefill.end_ns - prefill.start_ns) / 1e6:.1f} ms, decode {(decode.end_ns - decode.start_ns) / 1e6:.1f} "
          f"ms, {decode.attributes['kvwire.kv_bytes']} KV bytes in {decode.attributes['kvwire.transfer_ms']:.2f} ms")
