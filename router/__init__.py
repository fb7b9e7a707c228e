"""The HTTP front door: an OpenAI-compatible completions API over the prefill/decode pools.

File map (file: what it holds, as its own docstring opens):

- app.py: The router's HTTP API: POST /v1/completions, /v1/chat/completions, /tokenize and /detokenize; GET
  /v1/models, /healthz, /readyz, /metrics.
- body_limit.py: A cap on request bodies, for both routers: a body over it is refused before it is read.
- chat_template.py: Chat messages -> prompt text, with the checkpoint's own Jinja chat template, rendered as
  transformers does.
- choice.py: One choice of an answer as its `TokenChunk`s arrive: its tokens, their logprobs, and its text,
  detokenized incrementally and cut at the first stop string.
- config.py: The router process's configuration, built in `cli/`.
- dispatch.py: Sends work to nodes and routes their answers back to waiting HTTP requests.
- generation.py: One request's choices on the decode nodes: one sub-request per prompt and choice, their replies
  merged.
- in_flight.py: One request of this router over its own nodes: the dispatcher's single record of it, from its pick
  until it is forgotten.
- kv_events.py: vLLM's KV cache events, read by the router: a decode instance's prefix cache as it changes (vLLM's
  `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'`), for an
  exact prefix index (router/prefix_index.py).
- placement.py: Where a request of this router goes over kvwire's own nodes: its decode node and, unless it goes
  decode-only, its prefill node.
- prefix_index.py: Which instance holds which prompt prefix in its prefix cache, in KV blocks, predicted from the
  router's own routing (as Dynamo's approximate KV router and llm-d's prefix-cache scorer do).
- responses.py: Answer bodies in OpenAI's shapes: completions and chat completions, whole or as stream chunks.
- sampling.py: A checked request -> the `Plan` the router runs: its prompts' token ids, its choices, each choice's
  `SamplingParams`, and what the answer shows (stop strings, logprobs, echo, usage).
- schemas.py: OpenAI completions and chat-completions request shapes, and OpenAI-style errors.
- tokenize_routes.py: POST /tokenize and /detokenize, as vLLM serves them: the served model's token ids for a text
  (or a chat, rendered with its template) and back.
- vllm/: The router in front of vLLM servers (`kvwire router --vllm-prefill ... --vllm-decode ...`).
"""
