"""What a decode instance's answer says it read from its cache, against what the router predicted it held: a request
sent decode-only as held (cached-on-decode) that was computed again is counted, in whole answers and in streams."""

from __future__ import annotations

import json
import time

from kvwire.observability.metrics import Metrics
from kvwire.router.vllm.usage import cached_tokens_in, cached_tokens_of, check_held
from tests.router.fake_vllm import HEALTH_S, router_over

BODY = {"model": "fake", "max_tokens": 4}
BLOCKS_OF_16 = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="40"} 1.0'


def test_each_api_s_usage_says_its_cached_prompt_tokens():
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}) == 32  # completion, chat
    assert cached_tokens_of({"usage": {"input_tokens_details": {"cached_tokens": 16}}}) == 16  # a Response
    assert cached_tokens_of({"type": "response.completed",
                             "response": {"usage": {"input_tokens_details": {"cached_tokens": 8}}}}) == 8
    assert cached_tokens_of({"usage": {"input_tokens": 9, "cache_read_input_tokens": 4}}) == 4  # a Message
    assert cached_tokens_of({"usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}) is None  # not enabled
    assert cached_tokens_of({"choices": []}) is None
    stream = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in (
        {"choices": [{"text": "a"}]}, {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 48}}}))
    assert cached_tokens_in(stream + b"data: [DONE]\n\n", stream=True) == 48
    assert cached_tokens_in(b'data: {"choices": [{"text": "a"}]}\n\n', stream=True) is None
    assert cached_tokens_in(b"not json", stream=False) is None


def test_fewer_cached_tokens_than_predicted_is_a_miss_and_none_said_is_not_counted():
    metrics = Metrics()
    check_held(metrics, "r1", "http://d:1", 96, 64)
    check_held(metrics, "r2", "http://d:1", 96, 96)
    check_held(metrics, "r3", "http://d:1", 96, None)  # --enable-prompt-tokens-details off: not known
    text = metrics.exposition().decode()
    assert "kvwire_vllm_prefix_misses_total 1.0" in text and "kvwire_vllm_prefix_missed_tokens_total 32.0" in text


def test_a_request_sent_decode_only_as_held_that_read_less_from_the_cache_is_a_counted_miss(fakes):
    p, d1 = fakes["p"], fakes["d1"]
    p.metrics = d1.metrics = BLOCKS_OF_16
    d1.cached_tokens = 0  # say, its blocks were evicted
    with router_over([p], [d1], decode_only_below=40) as router:
        deadline = time.monotonic() + 10
        while d1.scrapes < 2:  # the block size is known once a health check read /metrics
            assert time.monotonic() < deadline, "the router never read the decode instance's metrics"
            time.sleep(HEALTH_S / 2)
        first = router.post("/v1/completions", json={**BODY, "prompt": list(range(100))})  # 6 blocks sent to d1
        later = [*range(100), *range(500, 510)]
        missed = router.post("/v1/completions", json={**BODY, "prompt": later})
        d1.cached_tokens = 96
        held = router.post("/v1/completions", json={**BODY, "prompt": later, "stream": True})
        d1.cached_tokens = 32
        streamed_miss = router.post("/v1/completions", json={**BODY, "prompt": later, "stream": True})
        metrics = router.get("/metrics").text
    assert first.headers["x-kvwire-path"] == "disaggregated"
    assert [r.headers["x-kvwire-reason"] for r in (missed, held, streamed_miss)] == ["cached-on-decode"] * 3
    assert "kvwire_vllm_prefix_misses_total 2.0" in metrics  # the first (0 of 96) and the last (32 of 96)
    assert "kvwire_vllm_prefix_missed_tokens_total 160.0" in metrics
