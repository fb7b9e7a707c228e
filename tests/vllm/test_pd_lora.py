"""LoRA adapters through `kvwire router` (default flags) over a vLLM pair (KvwireConnector over `auto`) that serves
two adapters of the tiny model, the decode server publishing its KV cache events to the router.

vLLM keeps each adapter's KV in a prefix cache of its own (its block hashes' extra keys), so the router must too
(router/vllm/cache_scope.py): a prompt the decode server holds under one adapter is not held under another, and a
request for the other is disaggregated, not sent decode-only to be computed whole there. Each answer equals the
prefill server's own for the same adapter; a later prompt of the first adapter is decode-only, read from its cache
as the router predicted (no prefix miss counted). A third adapter is loaded and unloaded at run time through the
router, which passes each call on to both servers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx2
import pytest

from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_cluster import VLLMServer, start_all
from kvwire.cluster.vllm_pd import kvwire_pair, routed
from kvwire.connectors.config import ConnectorKind
from kvwire.observability.labels import DISAGGREGATED_REASONS, PathReason
from tests.vllm.lora import RANK, write_tiny_lora
from tests.vllm.routed import complete, openai_client

pytest.importorskip("openai")

ADAPTERS = ("sql", "poet")
RUNTIME = "haiku"  # loaded at run time through the router (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
PROMPT = "The sea is wide and the ships are many. " * 18  # 720 tokens: disaggregated by default when not held


class LoRAPair(NamedTuple):
    router_url: str
    prefill: VLLMServer
    decode: VLLMServer
    runtime_path: Path  # RUNTIME's adapter, loaded by no server at start


@pytest.fixture(scope="module")
def lora_pair(vllm_model_dir: Path, redis_server: LocalRedis, tmp_path_factory) -> Iterator[LoRAPair]:
    log_dir = tmp_path_factory.mktemp("lora")
    modules = [f"{name}={write_tiny_lora(log_dir / name, vllm_model_dir, seed)}" for seed, name in enumerate(ADAPTERS)]
    lora = ("--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", *modules)
    runtime_path = write_tiny_lora(log_dir / RUNTIME, vllm_model_dir, len(ADAPTERS))
    events = f"ipc://{log_dir}/decode-kv-events"
    prefill, decode = kvwire_pair(vllm_model_dir, redis_server.url, ConnectorKind.AUTO, log_dir)
    env = (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)
    prefill = dataclasses.replace(prefill, node_id="prefill-lora", extra_args=lora, extra_env=env)
    decode = dataclasses.replace(decode, node_id="decode-lora", extra_env=env, extra_args=(
        *lora, "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": events})))
    servers = start_all([prefill, decode])
    with routed(servers, [servers[0].url], [servers[1].url], log_dir / "router.log",
                ("--vllm-kv-events", events)) as url:
        yield LoRAPair(url, servers[0], servers[1], runtime_path)


def test_a_prompt_held_under_one_adapter_is_disaggregated_for_another(lora_pair: LoRAPair, vllm_model_dir: Path):
    routed, own = openai_client(lora_pair.router_url), openai_client(lora_pair.prefill.url)
    answers = {}
    for model in (*ADAPTERS, str(vllm_model_dir)):  # the decode server holds PROMPT under the adapters before
        answer = complete(routed, model, PROMPT)
        reason = answer.headers["x-kvwire-reason"]
        assert reason in DISAGGREGATED_REASONS, f"{model}: {reason}"  # never held for this model: disaggregated
        assert answer.text == complete(own, model, PROMPT).text, model
        answers[model] = answer.text
    assert len(set(answers.values())) == 3, "each adapter changes the text: the KV read was its own"
    later = PROMPT + answers["sql"] + " And then?"
    answer = complete(routed, "sql", later)
    assert answer.headers["x-kvwire-reason"] == PathReason.CACHED_ON_DECODE  # held under sql: its KV events said
    assert (answer.cached_tokens or 0) >= len(PROMPT) // 128 * 128, answer.cached_tokens
    assert answer.text == complete(own, "sql", later).text
    metrics = httpx2.get(f"{lora_pair.router_url}/metrics").text
    assert "kvwire_vllm_prefix_misses_total 0.0" in metrics, "every request held where predicted read it"


def test_a_prompt_held_without_a_cache_salt_is_disaggregated_with_one(lora_pair: LoRAPair, vllm_model_dir: Path):
    """vLLM keeps a `cache_salt`'s blocks apart (a tenant's isolation): the router reads the salt from the body and
    from the decode server's KV events."""
    routed, own = openai_client(lora_pair.router_url), openai_client(lora_pair.prefill.url)
    model = str(vllm_model_dir)
    complete(routed, model, PROMPT)  # held unsalted (the test above asked it too)

    def salted(client, prompt: str):
        raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                                          extra_body={"cache_salt": "tenant-a"})
        out = raw.parse()
        return raw.headers.get("x-kvwire-reason"), out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    reason, text, _ = salted(routed, PROMPT)
    assert reason in DISAGGREGATED_REASONS, reason
    assert text == salted(own, PROMPT)[1]
    later = PROMPT + text + " And then?"
    reason, text, cached = salted(routed, later)
    assert reason == PathReason.CACHED_ON_DECODE and cached >= len(PROMPT) // 128 * 128, (reason, cached)
    assert text == salted(own, later)[1]
    assert "kvwire_vllm_prefix_misses_total 0.0" in httpx2.get(f"{lora_pair.router_url}/metrics").text


def test_an_adapter_loaded_at_run_time_through_the_router_serves_disaggregated(lora_pair: LoRAPair):
    """POST /v1/load_lora_adapter to the router reaches the prefill and the decode server (a disaggregated request
    needs the adapter on both); the unload too."""
    load = {"lora_name": RUNTIME, "lora_path": str(lora_pair.runtime_path)}
    loaded = httpx2.post(f"{lora_pair.router_url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200, loaded.text
    for server in (lora_pair.prefill, lora_pair.decode):
        assert RUNTIME in [card["id"] for card in httpx2.get(f"{server.url}/v1/models").json()["data"]]
    routed, own = openai_client(lora_pair.router_url), openai_client(lora_pair.prefill.url)
    answer = complete(routed, RUNTIME, PROMPT + " In three lines.")
    assert answer.headers["x-kvwire-reason"] in DISAGGREGATED_REASONS
    assert answer.text == complete(own, RUNTIME, PROMPT + " In three lines.").text
    assert answer.cached_tokens == answer.prompt_tokens, "every prompt token pulled, none computed on decode"
    unloaded = httpx2.post(f"{lora_pair.router_url}/v1/unload_lora_adapter", json={"lora_name": RUNTIME}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    for server in (lora_pair.prefill, lora_pair.decode):
        assert RUNTIME not in [card["id"] for card in httpx2.get(f"{server.url}/v1/models").json()["data"]]
