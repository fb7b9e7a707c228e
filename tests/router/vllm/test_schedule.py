"""Scheduler: a request's decode instance by the prefix it holds against its load, and its path."""

from __future__ import annotations

from kvwire.connectors.config import NodeRole
from kvwire.observability.labels import PathReason
from kvwire.router.config import RoutingPolicy
from kvwire.router.vllm.load import ServerLoad, parse_server_metrics
from kvwire.router.vllm.pool import InstancePool
from kvwire.router.vllm.schedule import Scheduler

P, D1, D2 = "http://p:1", "http://d1:1", "http://d2:1"
BLOCK = 16


def scheduler(policy: RoutingPolicy = RoutingPolicy.PREFIX, below: int = 40, measured: bool = True):
    prefill, decode = InstancePool(NodeRole.PREFILL, [P]), InstancePool(NodeRole.DECODE, [D1, D2])
    if measured:
        for pool, url in ((prefill, P), (decode, D1), (decode, D2)):
            pool.measured(url, ServerLoad(0, 0.0, BLOCK))
    return Scheduler(policy, below, 120.0, prefill, decode), decode


def serve(s: Scheduler, tokens: list[int], generated: int = 0) -> str:
    """Place a request, send it to the decode instance placed and have it answered; returns that instance."""
    placed = s.place(tokens)
    assert placed is not None
    s.sent(NodeRole.DECODE, placed.decode, tokens)
    s.answered(placed.decode, tokens, generated)
    return placed.decode


def test_turns_of_a_conversation_stay_on_one_instance_and_go_decode_only_while_other_conversations_spread():
    s, _ = scheduler()
    alice, bob = list(range(100)), list(range(1000, 1100))
    first = s.place(alice)
    assert first is not None and first.decode_only is None and first.held == 0  # 100 tokens held nowhere
    s.sent(NodeRole.DECODE, first.decode, alice)
    s.answered(first.decode, alice, 30)
    assert serve(s, bob, generated=30) != first.decode  # nothing held anywhere: the other one in turn
    turn2 = [*alice, *range(200, 230), *range(300, 310)]  # the answer (30 tokens), then 10 of the user's
    placed = s.place(turn2)
    assert placed is not None and placed.decode == first.decode
    assert placed.held == 128  # 6 full blocks, then turn 1's last 4 tokens and the 30 generated: 8 blocks
    assert placed.decode_only == PathReason.CACHED_ON_DECODE  # 140 - 128 = 12 tokens, under 40


def test_a_short_prompt_goes_decode_only_and_a_long_uncached_part_is_disaggregated():
    s, _ = scheduler(below=40)
    short = s.place(list(range(39)))
    assert short is not None and short.decode_only == PathReason.SHORT_PROMPT
    long = s.place(list(range(40)))
    assert long is not None and long.decode_only is None
    s0, _ = scheduler(below=0)  # 0: always disaggregated
    assert (placed := s0.place([1])) is not None and placed.decode_only is None


def test_a_busy_instance_loses_a_conversation_once_its_load_outweighs_the_blocks_held():
    s, decode = scheduler()
    prompt = list(range(64))  # 4 blocks
    home = serve(s, prompt)
    decode.started(home, blocks=3)  # 3 blocks of load against 4 to compute elsewhere: it stays
    assert (placed := s.place(prompt)) is not None and placed.decode == home
    decode.started(home, blocks=2)  # 5 blocks of load: computing the 4 blocks elsewhere costs less
    assert (placed := s.place(prompt)) is not None and placed.decode != home


def test_the_server_s_own_queue_and_a_nearly_full_kv_cache_count_as_load():
    s, decode = scheduler()
    prompt = list(range(64))  # 4 blocks
    home = serve(s, prompt)
    decode.measured(home, ServerLoad(waiting=0, kv_usage=0.5, block_size=BLOCK))  # the cache's use is not a load
    assert (placed := s.place(prompt)) is not None and placed.decode == home
    decode.measured(home, ServerLoad(waiting=2, kv_usage=0.0, block_size=BLOCK))  # 2 queued, 4 blocks each: 8
    assert (placed := s.place(prompt)) is not None and placed.decode != home
    decode.measured(home, ServerLoad(waiting=0, kv_usage=0.95, block_size=BLOCK))  # nearly full: 4 more, 16
    assert (placed := s.place(prompt)) is not None and placed.decode != home
    decode.measured(home, ServerLoad(waiting=0, kv_usage=0.0, block_size=BLOCK))
    assert (placed := s.place(prompt)) is not None and placed.decode == home


def test_the_router_s_own_requests_in_a_server_s_queue_are_not_counted_again():
    s, decode = scheduler()
    prompt = list(range(64))
    home = serve(s, prompt)
    decode.started(home, blocks=4)  # a request of the router, waiting there for its KV when the metrics are read
    decode.measured(home, ServerLoad(waiting=1, kv_usage=0.0, block_size=BLOCK), in_flight_then=1)
    decode.ended(home, blocks=4)  # answered; the figure read stays until the next GET /metrics
    assert decode.load(home, 4) == 0
    assert (placed := s.place(prompt)) is not None and placed.decode == home


def test_load_routing_ignores_what_instances_hold():
    s, _ = scheduler(RoutingPolicy.LOAD)
    prompt = list(range(64))
    homes = {serve(s, prompt) for _ in range(4)}
    assert homes == {D1, D2}


def test_an_instance_that_left_rotation_is_forgotten():
    s, decode = scheduler()
    prompt = list(range(64))
    home = serve(s, prompt)
    decode.take_out(home, "gone")
    assert (placed := s.place(prompt)) is not None and placed.decode != home
    decode.readmit(home)
    placed = s.place(prompt)
    assert placed is not None and placed.held == 0  # a restarted server's cache is empty


def test_an_instance_back_in_rotation_unseen_by_any_request_while_out_is_forgotten():
    """No request came while it was out (the health checks alone saw it go and come back): it may have restarted."""
    s, decode = scheduler()
    prompt = list(range(64))
    home = serve(s, prompt)
    decode.take_out(home, "gone")
    assert decode.readmit(home) is True and decode.readmit(home) is False  # back once
    s.back(NodeRole.DECODE, [home])
    placed = s.place(prompt)
    assert placed is not None and placed.held == 0


def test_before_any_instance_shows_its_block_size_requests_are_placed_by_load():
    s, _ = scheduler(measured=False, below=40)
    homes = {serve(s, list(range(64))) for _ in range(2)}
    assert homes == {D1, D2}
    assert (placed := s.place(list(range(8)))) is not None and placed.decode_only == PathReason.SHORT_PROMPT


def test_prompts_are_read_only_when_the_scheduler_uses_them():
    prefill, one = InstancePool(NodeRole.PREFILL, [P]), InstancePool(NodeRole.DECODE, [D1])
    assert not Scheduler(RoutingPolicy.PREFIX, 0, 120.0, prefill, one).reads_prompts()  # nothing to choose
    assert Scheduler(RoutingPolicy.PREFIX, 1, 120.0, prefill, one).reads_prompts()  # the path is decided on it
    two = InstancePool(NodeRole.DECODE, [D1, D2])
    assert Scheduler(RoutingPolicy.PREFIX, 0, 120.0, prefill, two).reads_prompts()
    assert not Scheduler(RoutingPolicy.LOAD, 0, 120.0, prefill, two).reads_prompts()


def test_vllm_metrics_give_queue_kv_blocks_in_use_and_block_size():
    text = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="40"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""
    assert parse_server_metrics(text) == ServerLoad(waiting=3, kv_usage=0.5, block_size=128, engines=(5, 1),
                                                    cache_dtype="auto")
    assert parse_server_metrics("") == ServerLoad(0, 0.0, 0)


def test_each_data_parallel_engines_requests_are_read():
    text = "\n".join([
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0'])
    assert parse_server_metrics(text) == ServerLoad(waiting=2, kv_usage=0.0, block_size=0, engines=(3, 4))
    one = 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\nvllm:num_requests_running{engine="0"} 1.0'
    assert parse_server_metrics(one).engines == ()


def test_a_prefill_instance_is_picked_only_of_a_block_size_that_pairs_with_the_decode_instance_s(caplog):
    """KV moves between block sizes where one divides the other: a decode instance whose size pairs with no
    prefill instance's takes its requests decode-only, said once (ERROR) with the sizes; unknown sizes pair."""
    p2 = "http://p2:1"
    prefill, decode = InstancePool(NodeRole.PREFILL, [P, p2]), InstancePool(NodeRole.DECODE, [D1, D2])
    s = Scheduler(RoutingPolicy.PREFIX, 0, 120.0, prefill, decode)
    assert s.prefill(list(range(40)), D1) in (P, p2)  # nothing shown yet: any
    prefill.measured(P, ServerLoad(0, 0.0, 64))
    prefill.measured(p2, ServerLoad(0, 0.0, 24))
    decode.measured(D1, ServerLoad(0, 0.0, 16))
    decode.measured(D2, ServerLoad(0, 0.0, 48))
    assert {s.prefill(list(range(40)), D1) for _ in range(4)} == {P}  # 16 divides 64, not 24
    assert s.prefill(list(range(40)), D2) == p2  # 48 = 2 x 24
    decode.measured(D2, ServerLoad(0, 0.0, 40))
    assert s.prefill(list(range(40)), D2) == PathReason.PREFILL_OTHER_BLOCK_SIZE
    assert s.prefill(list(range(40)), D2) == PathReason.PREFILL_OTHER_BLOCK_SIZE
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "KV blocks of 40 tokens" in errors[0] and "http://p:1: 64" in errors[0], errors
    prefill.take_out(P, "gone")
    prefill.take_out(p2, "gone")
    assert s.prefill(list(range(40)), D1) == PathReason.NO_PREFILL_INSTANCE


def test_a_prefill_instance_is_picked_only_of_the_decode_instance_s_kind_of_kv_cache(caplog):
    """An fp8 KV cache's bytes are not a bf16 one's: a decode instance whose cache dtype no prefill instance of a
    pairing block size keeps takes its requests decode-only, said once (ERROR); "auto" and the model's dtype are one
    kind, and an instance whose metrics said nothing yet pairs with any."""
    p2 = "http://p2:1"
    prefill, decode = InstancePool(NodeRole.PREFILL, [P, p2]), InstancePool(NodeRole.DECODE, [D1, D2])
    s = Scheduler(RoutingPolicy.PREFIX, 0, 120.0, prefill, decode)
    prefill.measured(P, ServerLoad(0, 0.0, 16, cache_dtype="fp8"))
    decode.measured(D1, ServerLoad(0, 0.0, 16, cache_dtype="fp8"))
    decode.measured(D2, ServerLoad(0, 0.0, 16, cache_dtype="bfloat16"))
    assert s.prefill(list(range(40)), D2) == p2  # not shown yet: pairs
    prefill.measured(p2, ServerLoad(0, 0.0, 16, cache_dtype="auto"))
    assert {s.prefill(list(range(40)), D1) for _ in range(4)} == {P}
    assert {s.prefill(list(range(40)), D2) for _ in range(4)} == {p2}  # auto: the model's dtype, as bfloat16 is
    prefill.take_out(p2, "gone")
    assert s.prefill(list(range(40)), D2) == PathReason.PREFILL_OTHER_KV_CACHE_DTYPE
    assert s.prefill(list(range(40)), D2) == PathReason.PREFILL_OTHER_KV_CACHE_DTYPE
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "a KV cache of the model dtype" in errors[0], errors


def test_vllm_metrics_give_the_kv_cache_dtype():
    text = 'vllm:cache_config_info{block_size="16",cache_dtype="fp8_e4m3",engine="0",num_gpu_blocks="40"} 1.0'
    assert parse_server_metrics(text).cache_dtype == "fp8_e4m3"
    assert parse_server_metrics("").cache_dtype == ""
