"""Model configuration: one frozen `ModelConfig` for the Llama-like decoder families.

The families (`Architecture`) share one decoder (engine/model.py) and differ in a few flags:
- Llama: optional attention biases (`attention_bias`: q/k/v/o), RoPE scaling (llama3, linear).
- Mistral: Llama without biases; a `sliding_window` shorter than `max_position_embeddings`
  is refused (attention here is always full; within the window both agree).
- Qwen2: biases on q/k/v only, always; `use_sliding_window` true is refused.
- Qwen3: RMSNorm over head_dim on each query and key head before RoPE (`qk_norm`), an
  explicit head_dim, optional q/k/v/o biases; `use_sliding_window` true is refused.
Any of them may tie the LM head to the embedding and use float32, float16 or bfloat16.

`from_hf_dict` reads a checkpoint's config.json; `to_hf_dict` writes one that
`transformers` loads as the architecture's `*ForCausalLM`. `PRESETS` names the configs
that `engine.init_model` can write as random checkpoints.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwire.connectors.wire import DType, KVLayout
from kvwire.engine.rope_scaling import RopeScaling, RopeType


class Architecture(enum.StrEnum):
    """The checkpoint families this engine runs, by their HF `architectures[0]` name."""

    LLAMA = "LlamaForCausalLM"
    MISTRAL = "MistralForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        """config.json's `model_type`."""
        return _MODEL_TYPES[self]


_MODEL_TYPES = {Architecture.LLAMA: "llama", Architecture.MISTRAL: "mistral",
                Architecture.QWEN2: "qwen2", Architecture.QWEN3: "qwen3"}
_HAS_BIAS_FLAG = (Architecture.LLAMA, Architecture.QWEN3)  # families whose config has `attention_bias`
_QWEN = (Architecture.QWEN2, Architecture.QWEN3)
_UNSUPPORTED_TRUE = ("mlp_bias",)  # HF flags this engine does not implement


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-like decoder (see the module docstring for the families).

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
        architecture: the family; it decides the checkpoint's tensors and config.json.
        attention_bias: Llama and Qwen3's flag: biases on q, k, v and o projections.
        rope_scaling: None for default RoPE.
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
    architecture: Architecture = Architecture.LLAMA
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None

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
        object.__setattr__(self, "architecture", Architecture(self.architecture))
        if self.attention_bias and self.architecture not in _HAS_BIAS_FLAG:
            raise ValueError(f"{self.architecture} has no attention_bias flag (Qwen2's q/k/v biases are implied)")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary of {self.vocab_size}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_bias(self) -> bool:
        """The q, k and v projections have biases."""
        return self.attention_bias or self.architecture is Architecture.QWEN2

    @property
    def o_bias(self) -> bool:
        """The output projection has a bias."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Queries and keys pass a per-head RMSNorm (`q_norm`, `k_norm`) before RoPE."""
        return self.architecture is Architecture.QWEN3

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json of a supported family.

        Args:
            d: the parsed config.json.
        Returns:
            The config.
        Raises:
            ValueError: a missing field, an unsupported architecture (the message lists the
                supported ones), or a feature this engine does not implement (MLP biases, a
                rope scaling other than llama3/linear, an activation other than silu, sliding
                window attention).
        """
        arch = _architecture(d)
        _check_supported(d, arch)
        rope = d.get("rope_parameters") or {}
        default_head_dim = 128 if arch is Architecture.QWEN3 else None  # Qwen3Config's default
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or default_head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=DType(d.get("dtype") or d.get("torch_dtype") or DType.FLOAT32),
            bos_token_id=_single_id(d.get("bos_token_id")),
            eos_token_id=_single_id(d.get("eos_token_id")),
            architecture=arch,
            attention_bias=bool(d.get("attention_bias", False)) and arch in _HAS_BIAS_FLAG,
            rope_scaling=RopeScaling.from_hf(d),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that `transformers` loads as the architecture's class (v4 and v5 keys)."""
        d: dict[str, Any] = {
            "architectures": [str(self.architecture)],
            "model_type": self.architecture.model_type,
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
            "attention_bias": self.attention_bias,
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
        if self.rope_scaling is not None:
            d["rope_parameters"] = self.rope_scaling.to_hf(self.rope_theta)
            d["rope_scaling"] = {k: v for k, v in d["rope_parameters"].items() if k != "rope_theta"}
        return _family_keys(self, d)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _family_keys(config: ModelConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """Turn a Llama config.json into the config's family's: drop the keys it lacks, add its own."""
    arch = config.architecture
    if arch is Architecture.LLAMA:
        return llama
    drop = {"mlp_bias", "pretraining_tp"} | ({"attention_bias"} if arch not in _HAS_BIAS_FLAG else set())
    d = {k: v for k, v in llama.items() if k not in drop}
    d["sliding_window"] = None  # full attention
    if arch in _QWEN:
        d |= {"use_sliding_window": False, "max_window_layers": config.num_hidden_layers}
    return d


def _architecture(d: dict[str, Any]) -> Architecture:
    """The family of an HF config: `architectures[0]`, else `model_type` (Llama when neither).

    Raises:
        ValueError: an unsupported family (the message lists the supported ones), or an
            `architectures` entry that contradicts `model_type`.
    """
    supported = ", ".join(f"{a} ({a.model_type})" for a in Architecture)
    model_type = d.get("model_type")
    names = d.get("architectures") or []
    if names:
        try:
            arch = Architecture(names[0])
        except ValueError:
            raise ValueError(f"architecture {names[0]!r} is not supported; supported: {supported}") from None
        if model_type is not None and model_type != arch.model_type:
            raise ValueError(f"model_type {model_type!r} contradicts architecture {arch} ({arch.model_type})")
        return arch
    for arch in Architecture:
        if arch.model_type == (model_type or "llama"):
            return arch
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}")


def _check_supported(d: dict[str, Any], arch: Architecture) -> None:
    """Raises ValueError for an HF config this engine cannot run, or one lacking a field."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
    for flag in _UNSUPPORTED_TRUE:
        if d.get(flag):
            raise ValueError(f"{flag}=true is not supported")
    _check_full_attention(d, arch)
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"config.json lacks {missing}")


def _check_full_attention(d: dict[str, Any], arch: Architecture) -> None:
    """Raises ValueError for sliding-window attention, which this engine does not implement."""
    sliding = [t for t in d.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise ValueError(f"layer_types {sorted(set(sliding))} are not supported (only full_attention)")
    if arch in _QWEN and d.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true is not supported ({arch}: attention is full here)")
    window, max_pos = d.get("sliding_window"), d.get("max_position_embeddings", 2048)
    if arch is Architecture.MISTRAL and window is not None and window < max_pos:
        raise ValueError(f"sliding_window {window} < max_position_embeddings {max_pos} is not supported "
                         f"(attention is full here); set sliding_window to null or >= {max_pos}")


def _single_id(value: int | list[int] | None) -> int | None:
    """HF allows a list of eos ids; the engine keeps the first."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def kv_layout(config: ModelConfig, block_size: int, model: str = "") -> KVLayout:
    """The KV pool layout a model with this config needs.

    Args:
        config: the model.
        block_size: tokens per KV block.
        model: the checkpoint's fingerprint (engine/fingerprint.py); "": not known.
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
        model=model,
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
# One tiny preset per family, the same byte-level vocabulary, all untied (see "tiny" above).
# llama3 scaling as Llama 3.1 has it, with a short original context so that it changes every
# frequency band; Qwen3's head_dim is not hidden/heads.
PRESETS |= {
    "tiny-llama3": PRESETS["tiny"].replace(
        rope_theta=500000.0, rope_scaling=RopeScaling(RopeType.LLAMA3, 8.0, 1.0, 4.0, 256)),
    "tiny-mistral": PRESETS["tiny"].replace(architecture=Architecture.MISTRAL, num_key_value_heads=1),
    "tiny-qwen2": PRESETS["tiny"].replace(architecture=Architecture.QWEN2, rms_norm_eps=1e-6,
                                          rope_theta=1000000.0),
    "tiny-qwen3": PRESETS["tiny"].replace(architecture=Architecture.QWEN3, head_dim=48, rms_norm_eps=1e-6,
                                          rope_theta=1000000.0),
}


def load_config(model_dir: Path) -> ModelConfig:
    """Read `model_dir/config.json`.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: the config describes something this engine cannot run.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return ModelConfig.from_hf_dict(json.loads(path.read_text()))
