"""A decode-role engine pulls a prompt's KV on the runner's pull thread: running requests keep decoding
meanwhile, the pulled request then continues exactly as if computed, and an abort mid-pull frees its blocks
only once the pull has stopped writing them. The connector here is a stand-in that "pulls" by computing the
prompt into the engine's own blocks when the test lets it."""

from __future__ import annotations

import select
import threading
import time

import pytest

from kvwire.connectors.base import KVConnectorBase
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.wakeup import Wakeup
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.loader import load_model
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner
from kvwire.protocol.work import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT_A, PROMPT_B = list(range(10, 30)), list(range(60, 97))


class _GatedPull(KVConnectorBase):
    def __init__(self, model):
        self.model = model
        self.go = threading.Event()
        self.pulling = threading.Event()

    def close(self) -> None:
        pass

    def send_kv_caches_and_hidden_states(self, *args) -> None:
        raise AssertionError("a decode node does not send")

    def recv_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches):
        self.pulling.set()
        assert self.go.wait(30)
        return self.model(model_input, kv_caches), True, model_input  # as if the producer's KV had landed


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _engine(model, connector=None, num_blocks=64, wakeup: Wakeup | None = None) -> LLMEngine:
    pool = KVPool.allocate(kv_layout(model.config, 4), num_blocks)
    runner = ModelRunner(model, pool, consumer=connector)
    return LLMEngine(runner, BlockAllocator(num_blocks), 256, model.config.eos_token_id, wakeup)


def _alone(model, prompt) -> list[int]:
    eng = _engine(model)
    seq = eng.add_request("x", prompt, PARAMS)
    while eng.has_unfinished():
        eng.step()
    return seq.output_ids


def _wait_received(eng: LLMEngine) -> None:
    deadline = time.monotonic() + 30
    while not all(f.done() for _, f in eng.receiving.values()):
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_running_requests_decode_while_a_prompt_is_pulled(model):
    conn = _GatedPull(model)
    wakeup = Wakeup()
    eng = _engine(model, conn, wakeup=wakeup)
    a = eng.add_request("a", PROMPT_A, PARAMS, receive_kv=False)
    eng.step()
    b = eng.add_request("b", PROMPT_B, PARAMS)
    for _ in range(3):
        eng.step()
    assert conn.pulling.is_set() and "b" in eng.receiving
    assert len(a.output_ids) == 4 and b.output_ids == [], "a decodes while b's KV is being pulled"
    conn.go.set()
    _wait_received(eng)
    assert select.select([wakeup.fd], [], [], 5)[0] and eng.can_step(), "the pull's end wakes the owner's loop"
    wakeup.close()
    while eng.has_unfinished():
        eng.step()
    assert b.bypassed and b.output_ids == _alone(model, PROMPT_B)
    assert a.output_ids == _alone(model, PROMPT_A)
    assert eng.allocator.num_free == 64
    eng.close()


def test_an_abort_mid_pull_frees_the_blocks_once_the_pull_ends(model):
    conn = _GatedPull(model)
    eng = _engine(model, conn)
    eng.add_request("a", PROMPT_A, PARAMS, receive_kv=False)
    eng.step()
    eng.add_request("c", PROMPT_B, PARAMS)
    eng.step()
    assert conn.pulling.wait(10)
    eng.abort("a")
    eng.abort("c")
    assert eng.allocator.num_free < 64, "the pull may still be writing c's blocks"
    assert not eng.can_step()  # nothing to do until the pull ends
    conn.go.set()
    _wait_received(eng)
    outputs = eng.step()
    assert outputs == [] and not eng.has_unfinished() and eng.allocator.num_free == 64
    eng.close()


class _TailPull(_GatedPull):
    """Takes a prompt's tail (its blocks before held in the engine's prefix cache)."""

    @property
    def receives_tails(self) -> bool:
        return True


def test_an_abort_mid_tail_pull_keeps_the_cached_prefix_and_frees_the_rest_once_the_pull_ends(model):
    """A pulled tail's prompt shares its cached prefix's blocks: aborted mid-pull, its fresh blocks are freed once
    the pull stops writing them, the shared ones stay cached (another prompt starts on them again), and none
    leaks."""
    conn = _TailPull(model)
    pool = KVPool.allocate(kv_layout(model.config, 4), 64)
    eng = LLMEngine(ModelRunner(model, pool, consumer=conn), BlockAllocator(64), 256, model.config.eos_token_id,
                    prefix_cache=True)
    first = eng.add_request("a", PROMPT_A, PARAMS, receive_kv=False)
    eng.step()
    shared = first.block_ids[:len(PROMPT_A) // 4]  # its prompt's 5 full blocks, named once computed
    eng.add_request("r", PROMPT_B, PARAMS, receive_kv=False)  # keeps the pull off the step's thread
    eng.step()
    tail = eng.add_request("c", PROMPT_A + [1, 2, 3], PARAMS)
    eng.step()
    assert conn.pulling.wait(10) and tail.num_cached_tokens == len(PROMPT_A) and tail.block_ids[:5] == shared
    eng.abort("c")
    eng.abort("a")
    eng.abort("r")
    assert eng.allocator.num_free < 64, "the pull may still be writing c's fresh blocks"
    conn.go.set()
    _wait_received(eng)
    eng.step()
    assert not eng.has_unfinished() and eng.allocator.num_free == 64
    again = eng.add_request("d", PROMPT_A + [4, 5, 6], PARAMS)
    while eng.has_unfinished():
        eng.step()
    assert again.num_cached_tokens == len(PROMPT_A) and again.block_ids == [] and again.bypassed
    eng.close()


def test_with_nothing_else_running_the_pull_happens_within_the_step(model):
    conn = _GatedPull(model)
    conn.go.set()
    eng = _engine(model, conn)
    b = eng.add_request("b", PROMPT_B, PARAMS)
    [out] = eng.step()
    assert out.sequence is b and len(out.new_token_ids) == 1 and b.bypassed and not eng.receiving
    eng.close()


class _CountingPull(_GatedPull):
    """Counts pulls running at once (a puller moves one request at a time)."""

    def __init__(self, model):
        super().__init__(model)
        self.go.set()
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def recv_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.05)
        try:
            return super().recv_kv_caches_and_hidden_states(model_executable, model_input, kv_caches)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("running_first", [False, True])
def test_a_step_never_runs_two_pulls_at_once(model, running_first):
    conn = _CountingPull(model)
    eng = _engine(model, conn)
    if running_first:
        eng.add_request("a", PROMPT_A, PARAMS, receive_kv=False)
        eng.step()
    seqs = [eng.add_request(f"r{i}", PROMPT_B, PARAMS) for i in range(3)]
    while eng.has_unfinished():  # as the node does: sleep while only pulls are under way
        if eng.can_step():
            eng.step()
        else:
            time.sleep(0.001)
    assert conn.most == 1 and all(s.bypassed for s in seqs)
    eng.close()
