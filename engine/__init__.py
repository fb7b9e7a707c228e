"""A small paged-KV inference engine for Llama-architecture models, shared by both nodes.

File map (file: what it holds, as its own docstring opens):

- block_allocator.py: Hands out KV blocks; prefers contiguous runs so transfers can move them as one piece; keeps
  computed prompt blocks as a prefix cache.
- block_names.py: Names for the full KV blocks of a token sequence, each standing for the whole prefix up to its
  block's end.
- byte_tokenizer_files.py: tokenizer.json and tokenizer_config.json for kvwire's byte-level random checkpoints.
- engine_config.py: How a process's engine is sized: the checkpoint, the KV pool, the device.
- gc_pauses.py: Keep Python's garbage collector from pausing a node in the middle of a transfer.
- init_model.py: Writes random, deterministic Hugging Face-format checkpoints of the `PRESETS` configs.
- llm_engine.py: Continuous batching over the model runner.
- loader.py: Loads a Hugging Face-format checkpoint (config.json + safetensors) of a supported family (Llama,
  Mistral, Qwen2, Qwen3: `model_config.Architecture`) into `LlamaForCausalLM`.
- model.py: A Llama-like decoder over a paged KV cache, numerically matching transformers' models.
- model_config.py: Model configuration: one frozen `ModelConfig` for the Llama-like decoder families.
- ops.py: Batch-invariant row-wise kernels.
- outputs.py: What an engine step reports: the tokens it sampled per request, and each request's timings (shaped
  like vLLM's).
- reference.py: Single-process generation: the same engine with no connector, the reference outputs that the
  disaggregated path must reproduce token for token.
- rope.py: Rotary position embeddings: the default RoPE and the scaled variants real checkpoints use.
- rope_scaling.py: A checkpoint's RoPE scaling, as its config.json says it: read, checked, written back (no torch).
- runner.py: Runs the model on one batch, calling the KV connector at the contract's two points.
- sampler.py: Next-token sampling, in vLLM's order: the repetition, frequency and presence penalties, min_tokens'
  ban on stop tokens, then greedy, or temperature, top-k, top-p (nucleus) and min-p with a per-request generator.
- sequence.py: One request as the engine tracks it: prompt, sampled tokens (and their logprobs), blocks, RNG,
  metrics.
- shared_prompts.py: A request's later choices (n > 1, best_of) that start from its first choice's prompt KV instead
  of computing or receiving the same prompt again, as vLLM forks a request's sequences from one prefill.
- tokenizer.py: Text <-> token ids: a checkpoint's tokenizer.json when it ships one, else raw UTF-8 bytes.
- validation.py: The one check of a prompt and of sampling parameters that the router, the nodes and the engine all
  apply.
- warmup.py: Warm a node's engine before it serves: the first request must not pay the device's start-up.
"""
