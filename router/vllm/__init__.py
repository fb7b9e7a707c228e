"""The router in front of vLLM servers (`kvwire router --vllm-prefill ... --vllm-decode ...`).

File map, in the order a request meets them:

- proxy.py: the routes (POST /v1/completions, /v1/chat/completions) and a request's life through them.
- tokens.py: its prompt as token ids, as vLLM makes them (what the prefix index is keyed by).
- schedule.py: where it goes and whether it is disaggregated, over the shared prefix index
  (router/prefix_index.py) and each server's own load (load.py, read from its GET /metrics).
- prefill.py: the prefill step of a disaggregated request, and what it learns of each prefill instance.
- pool.py: the instances of one role, weighed by load, out of rotation and back.
- bodies.py: the bodies sent to an instance, made from the client's; http.py: request ids, the headers
  passed on, an instance's whole answer; upstream.py: one call to an instance and how it can fail.
"""
