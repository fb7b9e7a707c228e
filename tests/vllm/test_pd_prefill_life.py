"""One named KvwireConnector pair over NCCL (Gloo here: `prefill-nccl`, `decode-nccl`, the router in front) through
its prefill server's life, started once for the module's tests, which run in this order:

0. tests/vllm/routed.py's checks (`routed_equals_plain`: whole, streamed and chat answers equal a plain server's,
   and the decode server computes no prompt token itself), on the fresh pair.
0b. n > 1: a request's choices (vLLM's children of one request, each with the parent's kv_transfer_params) are
   prefilled once and pulled once, the others starting from the decode server's prefix cache, each choice equal to
   a plain server's; and n > 1 sent to the prefill server itself under one key (as a proxy that passes n on does)
   holds the KV once and leaves the server serving once that hold lapses.
0c. Prompt logprobs: requests asking for them (completions and chat) go decode-only through the router, answers equal
   a plain server's; one sent to the decode server with a prefill server's kv_transfer_params (as another proxy
   would) is counted as `prompt_logprobs` and its hold released at once.
1. Delayed free: two prompts computed with do_remote_decode and never pulled keep their blocks in use
   (vLLM's KV cache usage above zero) until the prefill server's kv_deadline_s (LEASE_S), then the connector
   reports them finished sending, vLLM frees them, and their directory entries say EXPIRED.
2. The node id: a second server started under the live prefill server's id is refused at start-up, naming
   the live one, and the live one goes on serving (it is not fenced). That server is started as test 0 begins
   (the `duplicate` fixture), so that its start-up, about 30 s of three interpreters one after another, runs
   beside tests 0 and 1 rather than before test 2. Then the live one is killed and
   restarted under the same id: the entry of a prompt the first incarnation computed (its kv_transfer_params
   handed out, its KV never pulled) is FAILED by the second one as it starts, so a decode server sent that
   prompt recomputes it at once (well within the decode server's kv_deadline_s, WAIT_S); the router takes the
   restarted server back and disaggregates again. The restarted server is the pair's prefill server from then on.
3. SIGKILL mid-load: some requests are mid-way through the router when the prefill server dies; three more had
   their KV computed and held (their kv_transfer_params handed out) but not pulled yet. Decode recomputes
   what it cannot pull; afterwards no directory entry is left READY and every one expires.
2b. (between 2 and 3) A decode server of another checkpoint of the same shapes, started for the test: the pair's
   KV is refused as a mismatch and the prompt computed there, counted on its /metrics.

One pair instead of five saves four pairs' start-up (about 25-45 s each on this host): this pair is also the
one that checks NCCL between vLLM servers (TCP's is test_bench_vllm.py's pair). The module's Redis
database is emptied once, before the pair starts, not before each test: the nodes' registrations live there.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
import redis

from kvwire.cluster.local_cluster import ClusterError
from kvwire.cluster.redis_server import LocalRedis
from kvwire.cluster.vllm_cluster import VLLMServer
from kvwire.cluster.vllm_pd import PDCluster, counter_by_label, kvwire_pair, pd_cluster_of
from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.directory.directory import KVDirectory, TransferState
from tests.vllm.conftest import PROMPTS
from tests.vllm.routed import routed_equals_plain

LEASE_S = 8.0  # the prefill server's kv_deadline_s: how long it holds KV nobody pulls (test 0's are pulled)
WAIT_S = 20.0  # the decode server's kv_deadline_s: how long a request waits for KV that is not announced
MAX_TOKENS = 16
PROMPT_MIX = [p + f" variant {i}." for i in range(3) for p in PROMPTS]  # 9 distinct prompts


@pytest.fixture(scope="module")
def pair(vllm_model_dir: Path, redis_server: LocalRedis, tmp_path_factory) -> Iterator[PDCluster]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
    finally:
        client.close()
    log_dir = tmp_path_factory.mktemp("prefill-life")
    prefill, decode = kvwire_pair(vllm_model_dir, redis_server.url, ConnectorKind.NCCL, log_dir, kv_deadline_s=WAIT_S)
    with pd_cluster_of(dataclasses.replace(prefill, kv_deadline_s=LEASE_S), decode, log_dir) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def duplicate(pair: PDCluster, tmp_path_factory) -> Iterator[VLLMServer]:
    """A second server under the live prefill server's node id, started (not waited for): test 2 reads its refusal."""
    log = tmp_path_factory.mktemp("duplicate") / "duplicate.log"
    server = VLLMServer(dataclasses.replace(pair.prefill.spec, port=0, log_path=log)).start()
    yield server
    server.stop()


def _body(model: str, prompt: str, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _text(url: str, body: dict) -> str:
    r = httpx2.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _held_params(cluster: PDCluster, model: str, prompt: str) -> dict:
    """`prompt` computed on the prefill server alone (do_remote_decode): the kv_transfer_params it hands out."""
    body = _body(model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return httpx2.post(f"{cluster.prefill.url}/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]


@pytest.mark.usefixtures("duplicate")  # starts beside this test and the next (see the module's docstring)
def test_disaggregated_equals_plain_over_nccl(plain_server: VLLMServer, pair: PDCluster, vllm_model_dir: Path):
    routed_equals_plain(pair, plain_server, str(vllm_model_dir))  # first: the decode server's metrics are fresh


def test_a_prefill_server_that_would_drop_its_held_kv_when_stopped_says_so_at_start_up(pair: PDCluster):
    """vLLM's default --shutdown-timeout 0 aborts at once on SIGTERM, and the KV held for decode servers goes too
    (test_pd_schedule.py's prefill server runs with a timeout: stopped, it serves that KV first)."""
    said = "--shutdown-timeout is 0: when this server is stopped, the KV it holds for decode servers is dropped"
    assert pair.prefill.spec.log_path is not None and pair.decode.spec.log_path is not None
    assert said in pair.prefill.spec.log_path.read_text()
    assert said not in pair.decode.spec.log_path.read_text(), "a consumer holds nothing for others"


# --- 0b. n > 1 ----------------------------------------------------------------------------------------------------

CHOICES_PROMPT = "Several answers to one prompt share its prefill. " * 14  # 700 tokens: disaggregated


def test_n_choices_are_prefilled_and_pulled_once(plain_server: VLLMServer, pair: PDCluster, vllm_model_dir: Path):
    model = str(vllm_model_dir)
    body = _body(model, CHOICES_PROMPT, n=3, temperature=1.0, seed=4)
    computed = lambda: counter_by_label(pair.prefill.url, "vllm:prompt_tokens_by_source_total", "source")  # noqa: E731
    before = pair.kv_pulls(), pair.kv_failed_by_reason(), computed()
    routed = httpx2.post(f"{pair.router_url}/v1/completions", json=body, timeout=120)
    routed.raise_for_status()
    plain = httpx2.post(f"{plain_server.url}/v1/completions", json=body, timeout=120).json()
    assert [c["text"] for c in routed.json()["choices"]] == [c["text"] for c in plain["choices"]]
    assert routed.headers["x-kvwire-path"] == "disaggregated"
    assert pair.kv_pulls() - before[0] == 1 and pair.kv_failed_by_reason() == before[1]
    prompt_tokens = routed.json()["usage"]["prompt_tokens"]
    assert sum(computed().values()) - sum(before[2].values()) == prompt_tokens  # once, not once per choice

    # a proxy that passes n on to the prefill server with one key: one hold, the others' blocks back at once
    held = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "kvwire_key": "n3-one-key"}}
    assert httpx2.post(f"{pair.prefill.url}/v1/completions", json=held, timeout=60).status_code == 200
    deadline = time.monotonic() + LEASE_S + 20
    while _usage(pair.prefill) > 0:  # the one hold lapses (nobody pulls it)
        assert time.monotonic() < deadline, "the held KV was never freed"
        time.sleep(0.5)  # another process's state: polled
    # its next steps take the release (which stopped vLLM's engine when a second child's hold had taken the key)
    assert _text(pair.prefill.url, _body(model, PROMPTS[0] + " after n=3")) == _text(
        plain_server.url, _body(model, PROMPTS[0] + " after n=3"))
    assert httpx2.get(f"{pair.prefill.url}/health", timeout=10).status_code == 200


# --- 0c. prompt logprobs -----------------------------------------------------------------------------------------

LOGPROBS_PROMPT = "Every token of this prompt gets its logprob. " * 14  # 630 tokens: disaggregated were it not asked


def test_prompt_logprobs_go_decode_only_and_a_pull_vllm_skips_is_counted_and_released(
        plain_server: VLLMServer, pair: PDCluster, vllm_model_dir: Path):
    """vLLM computes a prompt whose logprobs are asked for whole, reading no KV of it (transferred or cached): the
    router sends it to the decode server alone, and a decode server told of KV anyway (another proxy) counts it and
    releases the prefill server's hold at once, not at its kv_deadline_s."""
    model = str(vllm_model_dir)
    pulls, failed = pair.kv_pulls(), pair.kv_failed_by_reason()
    for endpoint, body in (
            ("completions", _body(model, LOGPROBS_PROMPT, prompt_logprobs=1)),
            ("completions", _body(model, LOGPROBS_PROMPT + " Echoed.", echo=True, logprobs=1)),
            ("chat/completions", {"model": model, "messages": [{"role": "user", "content": LOGPROBS_PROMPT}],
                                  "max_tokens": MAX_TOKENS, "temperature": 0, "echo": True})):
        routed = httpx2.post(f"{pair.router_url}/v1/{endpoint}", json=body, timeout=120)
        routed.raise_for_status()
        assert routed.headers["x-kvwire-reason"] == "prompt-logprobs", (endpoint, body.keys())
        plain = httpx2.post(f"{plain_server.url}/v1/{endpoint}", json=body, timeout=120).json()
        assert routed.json()["choices"] == plain["choices"]
        assert routed.json().get("prompt_logprobs") == plain.get("prompt_logprobs")
    assert pair.kv_pulls() == pulls and pair.kv_failed_by_reason() == failed, "nothing meant to move, nothing failed"

    held_at = time.monotonic()
    params = _held_params(pair, model, LOGPROBS_PROMPT + " Held.")
    body = _body(model, LOGPROBS_PROMPT + " Held.", prompt_logprobs=1, kv_transfer_params=params)
    answer = httpx2.post(f"{pair.decode.url}/v1/completions", json=body, timeout=120).json()
    plain = httpx2.post(f"{plain_server.url}/v1/completions", json={**body, "kv_transfer_params": None}).json()
    assert answer["choices"][0]["prompt_logprobs"] == plain["choices"][0]["prompt_logprobs"]
    counted = time.monotonic() + 10  # vLLM records connector stats with an engine step's
    while pair.kv_failed_by_reason()["prompt_logprobs"] < failed.get("prompt_logprobs", 0) + 1:
        assert time.monotonic() < counted, pair.kv_failed_by_reason()
        time.sleep(0.2)  # another process's metrics: polled
    assert pair.kv_failed_by_reason()["prompt_logprobs"] == failed.get("prompt_logprobs", 0) + 1
    while _usage(pair.prefill) > 0:  # released at the decode server's word, well before the prefill's lease
        assert time.monotonic() < held_at + LEASE_S - 2, "the hold was kept until it lapsed"
        time.sleep(0.2)  # another process's state: polled


# --- 1. delayed free -------------------------------------------------------------------------------------------

def _usage(server: VLLMServer) -> float:
    text = httpx2.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)[1])


def test_unpulled_kv_is_held_until_its_lease_lapses(pair: PDCluster, vllm_model_dir: Path, redis_server: LocalRedis):
    ids = [_held_params(pair, str(vllm_model_dir), prompt)["remote_request_id"] for prompt in PROMPTS[:2]]
    time.sleep(1.0)  # metrics are published once a step
    assert _usage(pair.prefill) > 0, "the blocks handed over are still in use (delayed free)"
    deadline = time.monotonic() + LEASE_S + 15
    while _usage(pair.prefill) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _usage(pair.prefill) == 0, "the blocks were freed once the lease lapsed"
    directory = KVDirectory(redis_server.url)
    try:
        states = {rid: directory.get(rid) for rid in ids}
    finally:
        directory.close()
    assert all(e is not None and e.state == TransferState.EXPIRED for e in states.values()), states


# --- 2. the node id, and a restart -----------------------------------------------------------------------------

def test_a_live_prefills_id_is_refused_to_others_and_its_restart_fences_and_serves(
        plain_server: VLLMServer, pair: PDCluster, duplicate: VLLMServer, vllm_model_dir: Path,
        redis_server: LocalRedis):
    model, redis_url = str(vllm_model_dir), redis_server.url
    want = _text(plain_server.url, _body(model, PROMPTS[1]))
    _duplicate_refused(pair, duplicate)
    _used_again(model, pair)  # the live one was not fenced
    params = _held_params(pair, model, PROMPTS[1])
    _wait_ready_entry(redis_url, params["remote_request_id"])  # held and announced: what the restart fences
    failed = pair.kv_failed_by_reason()  # what earlier tests counted
    pair.prefill.kill()
    # the restarted server is the pair's prefill server from here on; the fixture stops it
    pair.prefill = VLLMServer(dataclasses.replace(pair.prefill.spec, port=pair.prefill.port)).start()
    pair.prefill.wait_ready()
    _fenced_and_recomputed(model, redis_url, pair.decode.url, params, want)
    _counted_where_vllm_users_look(pair, failed)
    _used_again(model, pair)


def _duplicate_refused(cluster: PDCluster, duplicate: VLLMServer) -> None:
    with pytest.raises(ClusterError, match="exited during start-up"):
        duplicate.wait_ready()
    log = duplicate.spec.log_path
    assert log is not None
    said = f"kvwire: node id '{cluster.prefill.spec.node_id}' is in use by a live server (vllm prefill, pid "
    assert said in log.read_text(), log.read_text()[-3000:]


def _wait_ready_entry(redis_url: str, request_id: str, timeout_s: float = 10.0) -> None:
    """The producer announces KV one engine step after it answered; a busy machine makes that step late."""
    directory = KVDirectory(redis_url)
    try:
        entry = directory.wait_for(request_id, {TransferState.READY}, time.monotonic() + timeout_s)
    finally:
        directory.close()
    assert entry is not None and entry.state == TransferState.READY, entry


def _fenced_and_recomputed(model: str, redis_url: str, decode_url: str, params: dict, want: str) -> None:
    directory = KVDirectory(redis_url)
    try:
        entry = directory.get(params["remote_request_id"])
    finally:
        directory.close()
    assert entry is not None and entry.state == TransferState.FAILED and "restarted" in entry.reason, entry
    start = time.monotonic()
    assert _text(decode_url, _body(model, PROMPTS[1], kv_transfer_params=params)) == want
    assert time.monotonic() - start < WAIT_S / 2, "a fenced entry is recomputed at once, not at the KV deadline"


def _counted_where_vllm_users_look(cluster, before: dict[str, float]) -> None:
    """The recompute shows on the decode server's own /metrics, by reason (stats reach it a step later): one more
    `producer` since `before`, nothing else."""
    deadline = time.monotonic() + 10
    grown: dict[str, float] = {}
    while time.monotonic() < deadline:
        grown = {r: n - before.get(r, 0) for r, n in cluster.kv_failed_by_reason().items()}
        if grown.get("producer", 0) >= 1:
            break
        time.sleep(0.2)  # vLLM records connector stats with its next engine step's
    assert grown["producer"] == 1 and sum(grown.values()) == 1, grown


def _used_again(model: str, cluster) -> None:
    before = cluster.prompt_tokens_by_source()
    deadline = time.monotonic() + 15  # the router's health check takes the restarted server back
    while True:
        r = httpx2.post(f"{cluster.router_url}/v1/completions", json=_body(model, PROMPTS[2]), timeout=60)
        if r.headers["x-kvwire-path"] == "disaggregated" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.headers["x-kvwire-path"] == "disaggregated"
    after = cluster.prompt_tokens_by_source()
    assert after["external_kv_transfer"] > before["external_kv_transfer"]


# --- 2b. another checkpoint -----------------------------------------------------------------------------------

def test_a_decode_server_of_another_checkpoint_refuses_the_kv(pair: PDCluster, vllm_model_dir: Path,
                                                               redis_server: LocalRedis, tmp_path: Path):
    """Same architecture and shapes, other weights: the pull is refused as a mismatch naming both checkpoints, the
    prompt computed on the decode server, and counted where vLLM's users look; no byte of the wrong KV is used."""
    from kvwire.engine.byte_tokenizer_files import write_byte_tokenizer
    from kvwire.engine.init_model import write_random_checkpoint

    other = tmp_path / "tiny-seed1"
    config = write_random_checkpoint(other, "tiny", 1)
    assert config.bos_token_id is not None and config.eos_token_id is not None
    write_byte_tokenizer(other, config.bos_token_id, config.eos_token_id)
    spec = dataclasses.replace(pair.decode.spec, model_dir=other, node_id="decode-other", port=0,
                               log_path=tmp_path / "other.log")
    stranger = VLLMServer(spec).start()
    try:
        stranger.wait_ready()
        params = _held_params(pair, str(vllm_model_dir), PROMPTS[0] + " Another checkpoint.")
        _wait_ready_entry(redis_server.url, params["remote_request_id"])
        body = _body(str(other), PROMPTS[0] + " Another checkpoint.", kv_transfer_params=params)
        assert _text(stranger.url, body)  # answered, computed on the stranger
        deadline = time.monotonic() + 10
        while (failed := counter_by_label(stranger.url, "vllm:kvwire_kv_transfers_failed_total", "reason")).get(
                "mismatch", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)  # vLLM records connector stats with its next engine step's
        assert failed["mismatch"] == 1 and sum(failed.values()) == 1, failed
        sources = counter_by_label(stranger.url, "vllm:prompt_tokens_by_source_total", "source")
        assert sources["external_kv_transfer"] == 0 and sources["local_compute"] > 0, sources
        assert "the producer's KV is of another checkpoint" in (tmp_path / "other.log").read_text()
    finally:
        stranger.stop()


# --- 3. SIGKILL mid-load ------------------------------------------------------------------------------------------

def test_prefill_killed_mid_load(plain_server: VLLMServer, pair: PDCluster, vllm_model_dir: Path,
                                 redis_server: LocalRedis):
    model = str(vllm_model_dir)
    want = {p: _text(plain_server.url, _body(model, p)) for p in PROMPT_MIX}
    held = {p: _held_params(pair, model, p) for p in PROMPT_MIX[:3]}  # computed, handed over, not pulled yet
    prefill_id = pair.prefill.spec.node_id
    assert all(h["do_remote_prefill"] and h["remote_engine_id"] == prefill_id for h in held.values()), held
    with ThreadPoolExecutor(len(PROMPT_MIX)) as pool:
        routed = {p: pool.submit(_text, pair.router_url, _body(model, p)) for p in PROMPT_MIX}
        time.sleep(0.5)  # some of them are on the prefill server now
        pair.prefill.kill()
        late = {p: pool.submit(_text, pair.decode.url, _body(model, p, kv_transfer_params=params))
                for p, params in held.items()}
        got = {p: f.result(timeout=120) for p, f in routed.items()}
        got_late = {p: f.result(timeout=120) for p, f in late.items()}
    assert got == want
    assert got_late == {p: want[p] for p in held}
    assert pair.routers[0].poll() is None and httpx2.get(f"{pair.decode.url}/health").status_code == 200
    _no_entry_left_ready(redis_server.url)


def _no_entry_left_ready(redis_url: str) -> None:
    directory = KVDirectory(redis_url)
    try:
        entries = directory.entries_with_age()
        assert entries, "the held requests left entries (FAILED by the consumer)"
        ready = [a.entry.request_id for a in entries if a.entry.state == TransferState.READY]
        assert not ready, f"entries of a dead producer still READY: {ready}"
    finally:
        directory.close()
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [*client.scan_iter("*:req:*"), *client.scan_iter("*:ev:*")]  # a request's keys (directory.py)
        ttls = {k: client.ttl(k) for k in keys}
        assert all(t > 0 for t in ttls.values()), f"keys that never expire: {[k for k, t in ttls.items() if t <= 0]}"
    finally:
        client.close()


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
