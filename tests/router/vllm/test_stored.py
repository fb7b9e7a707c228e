"""Stored Responses API answers: the router finds the decode instance that holds one (router/vllm/stored.py), for a
later turn naming it and for GET /v1/responses/{id}; against stand-in vLLM servers (tests/router/fake_vllm.py)."""

from __future__ import annotations

from kvwire.router.vllm.stored import StoredResponses, response_id_of
from tests.router.fake_vllm import router_over

ASK = {"model": "fake", "input": "hello", "max_output_tokens": 4}


def test_an_answers_id_is_read_from_a_whole_body_or_a_streams_first_event():
    whole = b'{"id": "resp_ab12", "output": [{"id": "msg_1", "type": "message"}]}'
    assert response_id_of(whole) == "resp_ab12"
    assert response_id_of(b'event: response.created\ndata: {"response":{"id":"resp_9-x_Y"}}\n\n') == "resp_9-x_Y"
    assert response_id_of(b'{"id": "chatcmpl-1"}') is None
    assert response_id_of(b"data: [DONE]") is None


def test_the_latest_ids_are_kept():
    stored = StoredResponses(limit=2)
    for i, url in enumerate(("a", "b", "c")):
        stored.remember(f"resp_{i}", url)
    assert (stored.home("resp_0"), stored.home("resp_1"), stored.home("resp_2"), len(stored)) == (None, "b", "c", 2)


def test_a_later_turn_goes_decode_only_to_the_instance_that_stored_the_earlier_one(fakes):
    p, d1, d2 = fakes["p"], fakes["d1"], fakes["d2"]
    with router_over([p], [d1, d2]) as router:
        answers = [router.post("/v1/responses", json={**ASK, "stream": i % 2 == 1}) for i in range(4)]
        homes = {(r.headers["x-kvwire-decode"], r.headers["x-kvwire-path"]) for r in answers}
        ids = [(response_id_of(r.content), r.headers["x-kvwire-decode"]) for r in answers]
        later = {home: router.post("/v1/responses", json={**ASK, "previous_response_id": rid}) for rid, home in ids}
        found = {rid: router.get(f"/v1/responses/{rid}") for rid, _ in ids}
    assert homes == {(d1.url, "disaggregated"), (d2.url, "disaggregated")}, "both decode instances stored answers"
    prefills = [b for b in p.bodies if b["kv_transfer_params"].get("do_remote_decode")]
    assert len(prefills) == 4 and all(b["max_output_tokens"] == 1 and b["store"] is False for b in prefills)
    for home, resp in later.items():
        assert resp.status_code == 200 and resp.headers["x-kvwire-decode"] == home
        assert (resp.headers["x-kvwire-path"], resp.headers["x-kvwire-reason"]) == ("decode-only", "previous-response")
    assert len(p.bodies) == 4, "a later turn never reaches a prefill instance (it lacks the earlier one)"
    name = {d1.url: "d1", d2.url: "d2"}
    for (rid, home), resp in zip(ids, found.values()):
        assert resp.status_code == 200 and resp.json() == {"id": rid, "by": name[home]}


def test_an_id_the_router_does_not_know_is_asked_of_each_decode_instance(fakes):
    d1, d2 = fakes["d1"], fakes["d2"]
    d2.stored.add("resp_elsewhere")  # answered through another router, say
    with router_over([], [d1, d2]) as router:
        found = [router.get("/v1/responses/resp_elsewhere") for _ in range(2)]
        missing = router.get("/v1/responses/resp_nowhere")
    assert all(r.status_code == 200 and r.json()["by"] == "d2" for r in found)
    assert missing.status_code == 404 and missing.json() == {"error": {"code": 404}}, "vLLM's own 404"
