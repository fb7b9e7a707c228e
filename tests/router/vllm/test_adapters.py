"""LoRA adapters loaded at run time through the vLLM-mode router (router/vllm/adapters.py), against stand-in vLLM
servers (tests/router/fake_vllm.py): every instance, prefill and decode, gets each load and unload, and one that
comes back into rotation (restarted: it has forgotten them) gets the loads again."""

from __future__ import annotations

import time

from tests.router.fake_vllm import HEALTH_S, router_over

LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def _until(done, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(HEALTH_S / 2)  # the router's health checks run on their own


def test_a_load_and_an_unload_reach_every_prefill_and_decode_instance(fakes):
    p, d1, d2 = fakes["p"], fakes["d1"], fakes["d2"]
    with router_over([p], [d1, d2]) as router:
        resp = router.post("/v1/load_lora_adapter", json=LOAD, headers={"authorization": "Bearer k"})
        assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'sql' added successfully."
        assert all(f.adapters == {"sql"} for f in (p, d1, d2))
        assert all(f.headers[-1]["authorization"] == "Bearer k" for f in (p, d1, d2))
        again = router.post("/v1/load_lora_adapter", json=LOAD)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        gone = router.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert gone.status_code == 200 and all(f.adapters == set() for f in (p, d1, d2))


def test_a_server_in_both_roles_is_asked_once(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    with router_over([p, d1], [d1]) as router:  # d1: kv_both, in both pools
        assert router.post("/v1/load_lora_adapter", json=LOAD).status_code == 200
    assert len(d1.bodies) == 1 and d1.adapters == {"sql"} and p.adapters == {"sql"}


def test_a_load_one_instance_refuses_is_answered_with_each_instances_answer_and_completed_by_a_retry(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    d1.missing.add(LOAD["lora_path"])  # e.g. a path the decode host does not have
    with router_over([p], [d1]) as router:
        resp = router.post("/v1/load_lora_adapter", json=LOAD)
        assert resp.status_code == 404
        message = resp.json()["error"]["message"]
        assert f"{d1.url} answered 404" in message and f"{p.url} answered 200" in message, message
        d1.missing.clear()  # the path is there now: the same load completes it (the prefill had it already)
        again = router.post("/v1/load_lora_adapter", json=LOAD)
        assert again.status_code == 200, again.text
    assert d1.adapters == {"sql"} and p.adapters == {"sql"}


def test_an_instance_back_in_rotation_is_given_the_adapters_loaded_through_the_router(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    with router_over([p], [d1]) as router:
        assert router.post("/v1/load_lora_adapter", json=LOAD, headers={"authorization": "Bearer k"}).status_code == 200
        d1.stop()  # a restart forgets runtime adapters
        _until(lambda: router.get("/healthz").json()["decode"]["down"] != [], "d1 seen down")
        d1.start()
        _until(lambda: d1.adapters == {"sql"}, "d1 given sql again once back")
        assert d1.headers[-1]["authorization"] == "Bearer k", "with the client's credentials (vLLM's --api-key)"
        assert p.adapters == {"sql"}
        assert router.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        d1.stop()
        _until(lambda: router.get("/healthz").json()["decode"]["down"] != [], "d1 seen down again")
        d1.start()
        _until(lambda: router.get("/healthz").json()["decode"]["down"] == [], "d1 back again")
    assert d1.adapters == set(), "an unloaded adapter is not given again"
