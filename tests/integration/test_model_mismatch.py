"""A prefill and a decode node of two checkpoints of one shape, as real processes: the router does not pair them
(the answer says why), and the decode node's output is its own checkpoint's, computed whole."""

from __future__ import annotations

import time

import httpx2
import pytest

from kvwire.cluster.local_cluster import ClusterSpec, LocalCluster
from kvwire.cluster.ports import free_port
from kvwire.cluster.vllm_pd import counter_by_label
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.engine.init_model import write_random_checkpoint
from kvwire.engine.reference import generate
from kvwire.protocol.work import SamplingParams
from tests.integration.cluster import complete
from tests.procs import FORK

pytestmark = pytest.mark.slow

PROMPT = list(range(40, 90))


def test_a_decode_node_of_another_checkpoint_gets_no_prefilled_kv(tiny_model_dir, tmp_path):
    other = tmp_path / "tiny-seed1"  # the same architecture and shapes: the KV layouts agree
    write_random_checkpoint(other, "tiny", 1)
    spec = ClusterSpec(model_dir=tiny_model_dir, connector=ConnectorKind.AUTO, num_blocks=128,
                       log_dir=tmp_path / "logs", launch=FORK)
    with LocalCluster(spec) as cluster:
        cluster.stop_process("decode")  # it leaves the directory; one of the other checkpoint takes its place
        cluster.http_ports["decode-1"] = free_port()
        args = cluster._node_args("decode-1")
        args[args.index("--model") + 1] = str(other)
        cluster.spawn("decode-1", args)
        directory = KVDirectory(cluster.redis_url)
        try:
            by = time.monotonic() + 60
            while [n.node_id for n in directory.live_nodes(NodeRole.DECODE)] != ["decode-1"]:
                assert time.monotonic() < by, "decode-1 did not register"
                time.sleep(0.1)
            models = {n.node_id: n.model for n in directory.live_nodes()}
        finally:
            directory.close()
        assert models["prefill-0"] and models["decode-1"] and models["prefill-0"] != models["decode-1"]
        ready = httpx2.get(f"{cluster.url}/readyz", timeout=10).json()
        assert (ready["ready"], ready["disaggregate"]) == (True, False), ready  # and says why
        got = complete(cluster.url, PROMPT, max_tokens=8)
        kv = got["kvwire"]
        assert (kv["path"], kv["reason"], kv["bypassed"], kv["prefill_node"], kv["transfer_failure"]) == \
            ("decode-only", "prefill-other-model", False, None, None)
        want = generate(other, [PROMPT], SamplingParams(max_tokens=8, temperature=0.0), block_size=16)[0]
        assert got["choices"][0]["token_ids"] == want
        reasons = counter_by_label(cluster.ops_urls["router"], "kvwire_path_reasons_total", "reason")
        assert reasons["prefill-other-model"] == 1
        decode_ops = f"http://127.0.0.1:{cluster.http_ports['decode-1']}"
        recomputed = counter_by_label(decode_ops, "kvwire_recomputes_total", "reason")
        assert recomputed["prefill_other_model"] == 1 and sum(recomputed.values()) == 1, recomputed
