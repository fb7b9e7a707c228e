"""The vLLM-mode router against stand-in vLLM servers on real sockets (tests/router/fake_vllm.py): what its
answers' x-kvwire-* headers say, and how it treats an instance that is slow, gone, or gone and back.

Real vLLM servers behind the router run in tests/vllm/.
"""

from __future__ import annotations

import json
import threading
import time

import httpx2
import pytest

from kvwire.cluster.ports import free_port
from kvwire.observability.metrics import Metrics
from kvwire.router.config import VLLMRouterConfig
from kvwire.router.vllm.proxy import create_vllm_app
from tests.router.fake_vllm import CONNECT_S, HEALTH_S, router_over, serve_in_thread

BODY = {"model": "fake", "prompt": "hello", "max_tokens": 4}


def test_answers_say_which_path_why_and_which_instances(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    with router_over([p], [d1]) as router:
        whole = router.post("/v1/completions", json=BODY)  # sequential: the first answer shows kvwire's connector
        streamed = router.post("/v1/completions", json={**BODY, "stream": True})  # alongside from then on
        p.hands_out_params = False  # say, restarted without kvwire's connector
        d1.answer_delay_s = 0.3  # the prefill's answer (no params) comes first: the decode call is cancelled
        cancelled = router.post("/v1/completions", json=BODY)
        d1.answer_delay_s = 0.0
        without = router.post("/v1/chat/completions", json={"model": "fake", "messages": []})  # sequential again
        metrics = router.get("/metrics").text
    assert whole.status_code == 200 and streamed.status_code == 200 and without.status_code == 200
    for resp, reason in ((whole, "prefilled"), (streamed, "prefilled-alongside")):
        assert (resp.headers["x-kvwire-path"], resp.headers["x-kvwire-reason"]) == ("disaggregated", reason)
        assert (resp.headers["x-kvwire-prefill"], resp.headers["x-kvwire-decode"]) == (p.url, d1.url)
    assert '"remote_engine_id": "p"' in whole.json()["choices"][0]["text"], "the prefill's params reached decode"
    assert '"text": "d1"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert (without.headers["x-kvwire-path"], without.headers["x-kvwire-reason"]) == ("decode-only",
                                                                                      "no-kv-transfer-params")
    assert "x-kvwire-prefill" not in without.headers and without.headers["x-kvwire-decode"] == d1.url
    assert cancelled.headers["x-kvwire-reason"] == "no-kv-transfer-params" and "got {}" in cancelled.text
    assert 'kvwire_vllm_path_reasons_total{path="disaggregated",reason="prefilled"} 1.0' in metrics
    assert 'kvwire_vllm_path_reasons_total{path="disaggregated",reason="prefilled-alongside"} 1.0' in metrics
    assert 'kvwire_vllm_path_reasons_total{path="decode-only",reason="no-kv-transfer-params"} 2.0' in metrics


def test_alongside_the_decode_instance_is_told_the_key_the_prefill_instance_holds_the_kv_under(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    d1.answer_delay_s = 0.3
    with router_over([p], [d1]) as router:
        router.post("/v1/completions", json=BODY)
        resp = router.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.headers["x-kvwire-reason"] == "prefilled-alongside"
    deadline = time.monotonic() + 10
    while len(p.bodies) < 2 and time.monotonic() < deadline:  # sent with the decode call, answered on its own
        time.sleep(0.01)
    key = p.bodies[-1]["kv_transfer_params"]["kvwire_key"]
    assert key.startswith("kvwire-") and p.bodies[-1]["max_tokens"] == 1
    assert d1.bodies[-1]["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                                   "remote_request_id": key, "remote_tp_size": 1,
                                                   "transfer": "kvwire"}


def test_sequential_waits_for_the_prefill_answer_every_time(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    with router_over([p], [d1], sequential=True) as router:
        reasons = [router.post("/v1/completions", json=BODY).headers["x-kvwire-reason"] for _ in range(3)]
    assert reasons == ["prefilled"] * 3 and all("kvwire_key" not in b["kv_transfer_params"] for b in p.bodies)
    assert [b["kv_transfer_params"]["remote_request_id"] for b in d1.bodies] == ["cmpl-1", "cmpl-2", "cmpl-3"]


def test_alongside_a_failed_prefill_cancels_the_waiting_decode_call_and_goes_decode_only(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    with router_over([p], [d1]) as router:
        router.post("/v1/completions", json=BODY)
        p.prefill_status = 500
        d1.kv_wait_s = 30.0  # the decode instance waits for KV that never comes
        started = time.monotonic()
        resp = router.post("/v1/completions", json=BODY)
        took = time.monotonic() - started
    assert resp.status_code == 200 and took < 10.0, took  # not the 30 s the waiting call would take
    assert (resp.headers["x-kvwire-path"], resp.headers["x-kvwire-reason"]) == ("decode-only", "prefill-failed")
    assert "kv_transfer_params" in d1.bodies[-2] and "kv_transfer_params" not in d1.bodies[-1]
    deadline = time.monotonic() + 5
    while not d1.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d1.aborted == 1, "the waiting decode call was cancelled (vLLM aborts its request)"
    assert "got {}" in resp.json()["choices"][0]["text"]


def test_no_prefill_instance_is_said_and_counted(fakes):
    with router_over([], [fakes["d1"]]) as router:
        resp = router.post("/v1/completions", json=BODY)
    assert (resp.headers["x-kvwire-path"], resp.headers["x-kvwire-reason"]) == ("decode-only", "no-prefill-instance")


def test_a_slow_decode_instance_stays_in_rotation_and_serves(fakes):
    d1 = fakes["d1"]
    d1.health_delay_s = 3 * CONNECT_S  # every probe times out: busy, not gone
    with router_over([], [d1], unresponsive_s=30.0) as router:
        time.sleep(3 * (HEALTH_S + CONNECT_S))
        health = router.get("/healthz").json()
        resp = router.post("/v1/completions", json=BODY)
    assert health["decode"]["up"] == [d1.url] and health["decode"]["slow"] == [d1.url], health
    assert resp.status_code == 200 and resp.headers["x-kvwire-decode"] == d1.url


def test_requests_go_to_the_less_loaded_decode_instance(fakes):
    d1, d2 = fakes["d1"], fakes["d2"]
    d1.answer_delay_s = d2.answer_delay_s = 0.5
    with router_over([], [d1, d2]) as router:
        slow = threading.Thread(target=router.post, args=("/v1/completions",), kwargs={"json": BODY})
        slow.start()
        while not d1.bodies and not d2.bodies:
            time.sleep(0.01)
        busy, idle = (d1, d2) if d1.bodies else (d2, d1)
        idle.answer_delay_s = 0.0
        others = [router.post("/v1/completions", json=BODY).headers["x-kvwire-decode"] for _ in range(3)]
        slow.join()
    assert others == [idle.url] * 3, f"{busy.url} was busy with the slow request"


def test_a_requests_n_choices_go_to_one_data_parallel_engine_the_least_busy(fakes):
    """vLLM spreads a request's n > 1 choices over its engines, each then pulling the one KV (the second fails, a
    recompute): the router names the engine with vLLM's x-data-parallel-rank, for n > 1 (or best_of) only."""
    d1 = fakes["d1"]
    d1.metrics = "\n".join(f'vllm:num_requests_{kind}{{engine="{e}",model_name="fake"}} {n}'
                           for kind, counts in (("waiting", (1, 0)), ("running", (2, 0))) for e, n in enumerate(counts))
    with router_over([], [d1]) as router:
        scraped, deadline = d1.scrapes, time.monotonic() + 10
        while d1.scrapes < scraped + 2:  # one health check read /metrics whole (the next has begun)
            assert time.monotonic() < deadline, "the router never read the decode instance's metrics"
            time.sleep(HEALTH_S / 2)  # another thread's state
        for body in (BODY, {**BODY, "n": 3}, {**BODY, "n": 1, "best_of": 2}):
            assert router.post("/v1/completions", json=body).status_code == 200
    ranks = [h.get("x-data-parallel-rank") for h in d1.headers]
    assert ranks == [None, "1", "1"], ranks


def test_a_batch_of_prompts_goes_decode_only_and_one_prompt_in_a_list_does_not(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    with router_over([p], [d1]) as router:
        batch = router.post("/v1/completions", json={**BODY, "prompt": ["hello", "world"]})
        one = router.post("/v1/completions", json={**BODY, "prompt": ["hello"]})
        ids = router.post("/v1/completions", json={**BODY, "prompt": [[1, 2], [3, 4]]})
    assert [(r.headers["x-kvwire-path"], r.headers["x-kvwire-reason"]) for r in (batch, one, ids)] == [
        ("decode-only", "batched-prompts"), ("disaggregated", "prefilled"), ("decode-only", "batched-prompts")]
    assert len(p.bodies) == 1  # the one prompt's prefill step alone


def test_a_gone_decode_instance_leaves_and_its_request_goes_to_another(fakes):
    d1, d2 = fakes["d1"], fakes["d2"]
    with router_over([], [d1, d2], instance_wait_s=5.0) as router:
        d1.stop()
        served = [router.post("/v1/completions", json=BODY) for _ in range(4)]
        health = router.get("/healthz").json()
    assert [r.status_code for r in served] == [200] * 4
    assert {r.headers["x-kvwire-decode"] for r in served} == {d2.url}
    assert [d["url"] for d in health["decode"]["down"]] == [d1.url]


def test_a_request_waits_for_the_only_decode_instance_to_come_back(fakes):
    d1 = fakes["d1"]
    with router_over([], [d1], instance_wait_s=10.0) as router:
        d1.stop()
        restarted = threading.Timer(0.5, d1.start)
        restarted.start()
        started = time.monotonic()
        resp = router.post("/v1/completions", json=BODY)
        waited = time.monotonic() - started
        restarted.join()
    assert resp.status_code == 200 and resp.headers["x-kvwire-decode"] == d1.url
    assert 0.25 < waited < 10.0, waited


def test_a_request_gets_503_once_no_decode_instance_came_back_within_the_wait(fakes):
    d1 = fakes["d1"]
    with router_over([], [d1], instance_wait_s=0.5) as router:
        d1.stop()
        started = time.monotonic()
        resp = router.post("/v1/completions", json=BODY, headers={"x-request-id": "req-9"})
        waited = time.monotonic() - started
    assert resp.status_code in (502, 503) and "req-9" in json.dumps(resp.json())
    assert 0.25 < waited < 3.0, waited


def test_a_request_goes_decode_only_while_every_prefill_instance_is_saturated(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    p.answer_delay_s = 0.5
    with router_over([p], [d1], prefill_max_in_flight=1, sequential=True) as router:
        first = threading.Thread(target=router.post, args=("/v1/completions",), kwargs={"json": BODY})
        first.start()
        while not p.bodies:
            time.sleep(0.01)
        second = router.post("/v1/completions", json=BODY)  # the prefill instance is busy with the first
        first.join()
        metrics = router.get("/metrics").text
    assert (second.headers["x-kvwire-path"], second.headers["x-kvwire-reason"]) == ("decode-only",
                                                                                    "prefill-saturated")
    assert len(p.bodies) == 1 and "x-kvwire-prefill" not in second.headers
    assert 'kvwire_vllm_path_reasons_total{path="decode-only",reason="prefill-saturated"} 1.0' in metrics


def test_a_client_that_goes_away_alongside_cancels_the_waiting_decode_call(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    config = VLLMRouterConfig(prefill_urls=(p.url,), decode_urls=(d1.url,), health_interval_s=HEALTH_S,
                              connect_timeout_s=CONNECT_S)
    port = free_port()
    server, thread = serve_in_thread(create_vllm_app(config, Metrics()), port, "router")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert httpx2.post(url, json=BODY, timeout=10).headers["x-kvwire-reason"] == "prefilled"
        p.answer_delay_s = d1.kv_wait_s = 30.0  # neither answers before the client gives up
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(url, json=BODY, timeout=0.5)
        deadline = time.monotonic() + 10
        while not d1.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d1.aborted == 1, "the decode call waiting for KV was cancelled with the client's request"
        metrics = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'kvwire_requests_total{status="cancelled"} 1.0' in metrics
    finally:
        p.answer_delay_s = 0.0
        server.should_exit = True
        thread.join(timeout=10)


def test_a_clients_trace_context_and_credentials_reach_both_instances(fakes, caplog):
    """W3C trace context passes through, so vLLM's OpenTelemetry spans join the client's trace; the router logs
    the trace id with the request."""
    p, d1 = fakes["p"], fakes["d1"]
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    sent = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01", "tracestate": "vendor=1", "authorization": "Bearer k",
            "x-request-id": "traced-1", "cookie": "not-for-vllm"}
    with caplog.at_level("INFO", logger="kvwire.router.vllm.proxy"), router_over([p], [d1]) as router:
        resp = router.post("/v1/completions", json=BODY, headers=sent)
    assert resp.status_code == 200 and resp.headers["x-kvwire-path"] == "disaggregated"
    for fake in (p, d1):
        got = fake.headers[-1]
        assert {k: got.get(k) for k in ("traceparent", "tracestate", "authorization", "x-request-id")} == \
            {k: sent[k] for k in ("traceparent", "tracestate", "authorization", "x-request-id")}
        assert "cookie" not in got
    assert f"request traced-1: trace {trace}" in caplog.text
