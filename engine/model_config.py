"""Model configuration: one frozen `ModelConfig` mirroring Hugging Face's `LlamaConfig`.

`from_hf_dict` reads a checkpoint's config.json; `to_hf_dict` writes one that
`transformers` loads as a `LlamaForCausalLM`. `PRESETS` names the configs that
`engine.init_model` can write as random checkpoints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvwire.connectors.wire import DType, KVLayout

_UNSUPPORTED_TRUE = ("attention_bias", "mlp_bias")  # HF flags this engine does not implement


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture decoder.

    Attributes:
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: K/V heads (grouped-query attention when fewer than query heads).
        head_dim: per-head width; None means hidden_size // num_attention_heads (filled in).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        max_position_embeddings: longest sequence the RoPE table covers.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        dtype: parameter and activation dtype.
        bos_token_id: beginning-of-sequence id written to config.json (informational).
        eos_token_id: end-of-sequence id written to config.json (informational).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    dtype: DType = DType.FLOAT32
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                                 f"num_attention_heads {self.num_attention_heads}")
            # frozen: the derived default is filled in once, here
            head_dim = self.hidden_size // self.num_attention_heads
            object.__setattr__(self, "head_dim", head_dim)
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        object.__setattr__(self, "dtype", DType(self.dtype))
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary of {self.vocab_size}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face Llama config.json.

        Args:
            d: the parsed config.json.
        Returns:
            The config.
        Raises:
            ValueError: a missing field, or a feature this engine does not implement
                (biases, rope scaling, an activation other than silu, another model type).
        """
        _check_supported(d)
        rope = d.get("rope_parameters") or {}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=DType(d.get("dtype") or d.get("torch_dtype") or DType.FLOAT32),
            bos_token_id=_single_id(d.get("bos_token_id")),
            eos_token_id=_single_id(d.get("eos_token_id")),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that `transformers` loads as `LlamaForCausalLM` (v4 and v5 keys)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "initializer_range": 0.02,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": str(self.dtype),
            "dtype": str(self.dtype),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": None,
            "use_cache": True,
        }

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_supported(d: dict[str, Any]) -> None:
    """Raises ValueError for an HF config this engine cannot run, or one lacking a field."""
    if d.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type {d.get('model_type')!r} is not 'llama'")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
    for flag in _UNSUPPORTED_TRUE:
        if d.get(flag):
            raise ValueError(f"{flag}=true is not supported")
    for rope in (d.get("rope_scaling") or {}, d.get("rope_parameters") or {}):
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope!r} is not supported")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"config.json lacks {missing}")


def _single_id(value: int | list[int] | None) -> int | None:
    """HF allows a list of eos ids; the engine keeps the first."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def kv_layout(config: ModelConfig, block_size: int) -> KVLayout:
    """The KV pool layout a model with this config needs.

    Args:
        config: the model.
        block_size: tokens per KV block.
    Returns:
        The layout (one K and one V per layer, `num_kv_heads x head_dim` per token).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    assert config.head_dim is not None  # filled in by ModelConfig.__post_init__
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=config.dtype,
    )


# Byte-level vocabulary: ids 0..255 are bytes, 256 = bos, 257 = eos, the rest unused
# (320 keeps the LM head a multiple of 64 rows). Both untied: engine.init_model gives
# untied heads an anti-repetition term (tied models load and run all the same).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, dtype=DType.FLOAT32,
        bos_token_id=256, eos_token_id=257,
    ),
    "small": ModelConfig(
        vocab_size=320, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, dtype=DType.FLOAT32,
        bos_token_id=256, eos_token_id=257,
    ),
}
