"""Writes random, deterministic Hugging Face-format checkpoints of the `PRESETS` configs.

The init is not HF's (std 0.02 everywhere): with weights that small every layer is
a near no-op, the next token depends on the current one alone and greedy decoding
falls into loops. Here:
- each projection has std `1/sqrt(fan_in)`, so attention and MLP outputs are as
  large as the residual stream and the context matters;
- the LM head is scaled so logits have std ~`LOGIT_STD`, and an untied head
  subtracts `ANTI_COPY` x each token's own embedding, so a token scores low right
  after itself (random models otherwise lock into one token repeated);
- attention biases (Qwen2, or `attention_bias`) have std `BIAS_STD`; every norm weight
  (Qwen3's q_norm / k_norm too) is one;
- only the head rows of `EMITTED_BYTES` (printable ASCII and newline) are random;
  the rest are zero, so their logits are exactly 0 while the best emitted logit is
  ~+2.5 std: greedy output decodes as clean text and never hits bos/eos.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvwire.connectors.kv_pool import TORCH_DTYPES
from kvwire.engine.model_config import PRESETS, ModelConfig

LOGIT_STD = 2.0
ANTI_COPY = 1.0
BIAS_STD = 0.1
EMITTED_BYTES = (ord("\n"), *range(ord(" "), ord("~") + 1))  # printable ASCII and newline


def _emitted_mask(vocab_size: int) -> torch.Tensor:
    """`[vocab]` bool: the ids whose head rows are random (the rest are zero)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[[i for i in EMITTED_BYTES if i < vocab_size]] = True
    return mask


def get_preset(name: str) -> ModelConfig:
    """The named preset config.

    Raises:
        KeyError: unknown name (the message lists the presets).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"Unsupported preset: {name!r}; choose one of {sorted(PRESETS)}") from None


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of this config's family, by name, in a fixed order."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    assert d is not None  # filled in by ModelConfig.__post_init__
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights (see the module docstring for the scheme).

    Args:
        config: the model.
        seed: the same seed gives bit-identical tensors.
    Returns:
        Tensors by HF name, in the config's dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            out[name] = _embedding(shape, config, gen)
        elif name == "lm_head.weight":
            out[name] = _untied_head(out["model.embed_tokens.weight"], gen)
        elif name.endswith(".bias"):
            out[name] = torch.randn(shape, generator=gen) * BIAS_STD
        else:
            out[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5  # std 1/sqrt(fan_in)
    dtype = TORCH_DTYPES[config.dtype]
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def _embedding(shape: tuple[int, ...], config: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """`[vocab, hidden]`, std 1. Tied, it is also the head: it takes the head's scale and
    zero rows, and gets no anti-copy term (tied random models repeat more readily)."""
    w = torch.randn(shape, generator=gen)
    if config.tie_word_embeddings:
        w *= LOGIT_STD / shape[1] ** 0.5
        w[~_emitted_mask(shape[0])] = 0.0
    return w


def _untied_head(embed: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`[vocab, hidden]`: random rows minus ANTI_COPY x the token's own embedding."""
    vocab, hidden = embed.shape
    w = (torch.randn(vocab, hidden, generator=gen) - ANTI_COPY * embed) / (1 + ANTI_COPY**2) ** 0.5
    w *= LOGIT_STD / hidden**0.5
    w[~_emitted_mask(vocab)] = 0.0
    return w


def write_random_checkpoint(out_dir: Path, preset: str, seed: int) -> ModelConfig:
    """Write config.json + model.safetensors for a random model of a preset.

    Args:
        out_dir: created if absent.
        preset: a key of `PRESETS`.
        seed: weights are a pure function of (preset, seed).
    Returns:
        The config written.
    Raises:
        KeyError: unknown preset (the message lists the presets).
    """
    return write_checkpoint(out_dir, get_preset(preset), seed)


def write_checkpoint(out_dir: Path, config: ModelConfig, seed: int) -> ModelConfig:
    """Write config.json + model.safetensors for a random model of any config.

    Args:
        out_dir: created if absent.
        config: the model.
        seed: weights are a pure function of (config, seed).
    Returns:
        config.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    # one metadata entry only: safetensors writes a map's entries in hash order, so
    # more than one would make the file's bytes vary from run to run
    save_file(random_tensors(config, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return config
