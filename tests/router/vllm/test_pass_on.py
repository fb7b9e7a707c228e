"""Calls the vLLM-mode router passes on to a decode instance as they are (router/vllm/pass_on.py), against stand-in
vLLM servers (tests/router/fake_vllm.py)."""

from __future__ import annotations

from tests.router.fake_vllm import router_over


def test_a_passed_on_call_reaches_a_decode_instance_as_the_client_made_it(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    body = {"model": "fake", "tokens": [104, 105]}
    with router_over([p], [d1]) as router:
        resp = router.post("/detokenize", json=body, headers={"authorization": "Bearer k", "x-request-id": "pass-1"})
    assert resp.status_code == 200 and resp.json() == {"prompt": "by d1"}
    assert (resp.headers["x-kvwire-decode"], resp.headers["x-request-id"]) == (d1.url, "pass-1")
    assert "x-kvwire-path" not in resp.headers and not p.bodies, "no prefill instance takes part"
    assert d1.bodies == [body] and d1.headers[-1]["authorization"] == "Bearer k"


def test_a_call_that_does_not_reach_one_decode_instance_goes_to_the_next(fakes):
    d1, d2 = fakes["d1"], fakes["d2"]
    with router_over([], [d1, d2]) as router:
        assert {router.post("/detokenize", json={"tokens": [1]}).json()["prompt"] for _ in range(2)} == {
            "by d1", "by d2"}, "both take calls in turn"
        d1.stop()  # gone, before or after the router's health checks have seen it: refused, or not asked
        answers = [router.post("/detokenize", json={"tokens": [1]}) for _ in range(3)]
    assert [r.json() for r in answers] == [{"prompt": "by d2"}] * 3


def test_with_no_decode_instance_up_a_passed_on_call_is_503_in_openai_shape(fakes):
    d1 = fakes["d1"]
    d1.stop()
    with router_over([], [d1]) as router:
        resp = router.post("/detokenize", json={"tokens": [1]})
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
