"""Tiny random checkpoints of every supported family, written by transformers itself.

kvwire's own writer (engine/init_model.py) could share a misreading of a format with
kvwire's loader; a checkpoint that transformers builds and saves cannot. Any test may
use `make_hf_checkpoint` (engine parity here, the disaggregated path elsewhere): the
checkpoints use kvwire's byte-level vocabulary (ids 0..255 bytes, 256 bos, 257 eos,
320 rows), so the default `ByteTokenizer` reads them, and they carry a chat template.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import torch
import transformers

from kvwire.connectors.wire import DType
from kvwire.engine.byte_tokenizer_files import write_chat_template
from kvwire.engine.init_model import EMITTED_BYTES

VOCAB, BOS, EOS = 320, 256, 257
LOGIT_STD = 2.0


class Family(enum.StrEnum):
    """What `make_hf_checkpoint` can write."""

    LLAMA = "llama"
    LLAMA3 = "llama3"  # Llama with Llama 3.1 rope scaling over a short original context
    MISTRAL = "mistral"
    QWEN2 = "qwen2"  # q/k/v biases
    QWEN3 = "qwen3"  # per-head q/k RMSNorm, head_dim != hidden / heads


_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=BOS,
    eos_token_id=EOS, pad_token_id=None,
)
# llama3: every wavelength above 64 positions is scaled, those between 16 and 64 smoothed
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
_FAMILY: dict[Family, tuple[type, type, dict[str, Any]]] = {
    Family.LLAMA: (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    Family.LLAMA3: (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_parameters": _LLAMA3_ROPE}),
    Family.MISTRAL: (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    Family.QWEN2: (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"rope_theta": 1e6}),
    Family.QWEN3: (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24, "rope_theta": 1e6}),
}


def make_hf_checkpoint(family: str, path: Path, dtype: str | DType = DType.FLOAT32, tied: bool = False,
                       seed: int = 0, **config_overrides: Any) -> Path:
    """Build a tiny random model with transformers and `save_pretrained` it.

    Weights are scaled so that every layer matters and logits have std ~`LOGIT_STD`; only
    the LM head rows of printable ASCII and newline are non-zero, so greedy output is text
    and never bos/eos.

    Args:
        family: a `Family` value ("llama", "llama3", "mistral", "qwen2", "qwen3").
        path: the checkpoint directory (created).
        dtype: "float32", "float16" or "bfloat16".
        tied: tie the LM head to the embedding.
        seed: weights are a pure function of (family, dtype, tied, seed, overrides).
        config_overrides: passed to the transformers config (e.g. `attention_bias=True`).
    Returns:
        path, holding config.json, model.safetensors and chat_template.jinja.
    Raises:
        ValueError: an unknown family.
    """
    config_cls, model_cls, extra = _FAMILY[Family(family)]
    dtype = DType(dtype)
    config = config_cls(**(_COMMON | extra | config_overrides), tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = model_cls(config)
    _scale_weights(model, torch.Generator().manual_seed(seed))
    model.to(getattr(torch, str(dtype)))
    path = Path(path)
    model.save_pretrained(path)
    write_chat_template(path)
    return path


@torch.no_grad()
def _scale_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """HF's std-0.02 init leaves a near no-op model; give each tensor a scale that matters."""
    emitted = torch.zeros(VOCAB, dtype=torch.bool)
    emitted[list(EMITTED_BYTES)] = True
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    for name, p in model.named_parameters():  # a tied head is the embedding, listed once
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name == head:
            p.copy_(torch.randn(p.shape, generator=gen) * LOGIT_STD / p.shape[1] ** 0.5)
            p[~emitted] = 0.0  # never emits bytes outside printable ASCII, nor the specials
        elif name == "model.embed_tokens.weight":
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)  # std 1/sqrt(fan_in)
