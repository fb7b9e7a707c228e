"""Run as a script by test_offline.py: one offline vLLM `LLM` with KvwireConnector as consumer, one process.

Generates each prompt plainly, then again under kv_transfer_params whose KV never comes (no such
producer, a FAILED directory entry, malformed or mismatched params), and prints JSON lines
`{"case", "tokens", "seconds"}` so the test can check every case recomputed the plain tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(model: str, redis_url: str, prompt: str, deadline_s: float) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvwire.connectors.directory.directory import KVDirectory

    transfer = KVTransferConfig(kv_connector="KvwireConnector", kv_connector_module_path="kvwire.connectors.vllm",
                                kv_role="kv_consumer",
                                kv_connector_extra_config={"redis_url": redis_url, "transport": "tcp",
                                                           "kv_deadline_s": deadline_s, "node_id": "offline-consumer"})
    llm = LLM(model=model, kv_transfer_config=transfer, max_model_len=2048, enforce_eager=True)
    n = len(llm.get_tokenizer().encode(prompt))
    directory = KVDirectory(redis_url)
    directory.fail("failed-1", "the producer gave up")

    def remote(rid: str, **over) -> dict:
        return {"do_remote_prefill": True, "remote_request_id": rid, "remote_engine_id": "ghost-producer",
                "remote_num_tokens": n, "remote_block_ids": [1, 2, 3], "transfer": "kvwire", **over}

    cases = {"plain": None, "no-producer": remote("nope-1"), "failed-entry": remote("failed-1"),
             "malformed": remote("bad-1", remote_num_tokens="many"), "mismatched": remote("short-1",
                                                                                          remote_num_tokens=n - 5)}
    for case, params in cases.items():
        sp = SamplingParams(temperature=0, max_tokens=16, extra_args={"kv_transfer_params": params} if params else None)
        start = time.monotonic()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        print(json.dumps({"case": case, "tokens": list(out.outputs[0].token_ids),
                          "seconds": time.monotonic() - start}), flush=True)
    directory.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
