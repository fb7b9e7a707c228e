"""ModelConfig: HF round trip, validation, presets, KV layout."""

from __future__ import annotations

import pytest

from kvwire.connectors.wire import DType
from kvwire.engine.model_config import PRESETS, Architecture, ModelConfig, kv_layout
from kvwire.engine.rope_scaling import RopeScaling, RopeType


def test_hf_dict_round_trip() -> None:
    for name, config in PRESETS.items():
        d = config.to_hf_dict()
        arch = config.architecture
        assert d["architectures"] == [str(arch)] and d["model_type"] == arch.model_type
        assert d["torch_dtype"] == "float32" and d["hidden_act"] == "silu"
        assert d.get("attention_bias", False) is False and d.get("mlp_bias", False) is False
        assert ModelConfig.from_hf_dict(d) == config, name
    for config in (PRESETS["tiny"].replace(attention_bias=True),
                   PRESETS["tiny-qwen3"].replace(attention_bias=True, dtype=DType.BFLOAT16)):
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_families_and_their_flags() -> None:
    assert {p.architecture for p in PRESETS.values()} == set(Architecture)
    qwen2, qwen3 = PRESETS["tiny-qwen2"], PRESETS["tiny-qwen3"]
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim * qwen3.num_attention_heads != qwen3.hidden_size
    assert not any((PRESETS["tiny-mistral"].qkv_bias, PRESETS["tiny"].qk_norm, PRESETS["tiny"].o_bias))
    assert kv_layout(qwen3, 16).head_dim == 48  # the real head_dim, not hidden / heads
    assert PRESETS["tiny-llama3"].rope_scaling == RopeScaling(RopeType.LLAMA3, 8.0, 1.0, 4.0, 256)
    with pytest.raises(ValueError, match="attention_bias"):
        qwen2.replace(attention_bias=True)


def test_family_from_model_type_and_rope_scaling_keys() -> None:
    d = PRESETS["tiny-qwen3"].to_hf_dict()
    del d["architectures"], d["head_dim"]
    config = ModelConfig.from_hf_dict(d)
    assert config.architecture is Architecture.QWEN3 and config.head_dim == 128  # Qwen3Config's default
    v4 = PRESETS["tiny"].to_hf_dict() | {"rope_parameters": None, "rope_theta": 5e5,
                                         "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = ModelConfig.from_hf_dict(v4)
    assert config.rope_scaling == RopeScaling(RopeType.LINEAR, 2.0) and config.rope_theta == 5e5


def test_windows_that_cover_the_context_are_accepted() -> None:
    mistral = PRESETS["tiny-mistral"].to_hf_dict()
    for window in (None, mistral["max_position_embeddings"], 10**6):
        assert ModelConfig.from_hf_dict(mistral | {"sliding_window": window}) == PRESETS["tiny-mistral"]
    qwen2 = PRESETS["tiny-qwen2"].to_hf_dict() | {"sliding_window": 4096, "layer_types": ["full_attention"] * 4}
    assert ModelConfig.from_hf_dict(qwen2) == PRESETS["tiny-qwen2"]  # use_sliding_window false: full attention


def test_from_hf_dict_defaults_and_legacy_keys() -> None:
    d = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": [7, 8]}
    config = ModelConfig.from_hf_dict(d)
    assert config.head_dim == 32 and config.num_key_value_heads == 8
    assert config.rope_theta == 500000.0 and config.dtype is DType.BFLOAT16
    assert config.eos_token_id == 7


@pytest.mark.parametrize("change, message", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "MistralForCausalLM.*Qwen3ForCausalLM"),
    ({"architectures": None, "model_type": "gemma"}, "not supported; supported: LlamaForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "lacks 'factor'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}}, "llama3 rope scaling lacks"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "sliding_attention"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 1024}, "sliding_window"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True},
     "use_sliding_window"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"bos_token_id": 320}, "outside the vocabulary"),
    ({"torch_dtype": "float64", "dtype": "float64"}, "float64"),
])
def test_unsupported_configs_raise(change: dict, message: str) -> None:
    d = PRESETS["tiny"].to_hf_dict() | change
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_validation_in_post_init() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(vocab_size=10, hidden_size=0, intermediate_size=4, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1)
    with pytest.raises(ValueError, match="not a multiple of num_attention_heads"):
        ModelConfig(vocab_size=10, hidden_size=30, intermediate_size=4, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ValueError, match="even"):
        PRESETS["tiny"].replace(head_dim=33)


def test_tiny_preset_shape() -> None:
    tiny = PRESETS["tiny"]
    assert tiny.vocab_size >= 257 and tiny.num_key_value_heads < tiny.num_attention_heads
    assert tiny.max_position_embeddings >= 2048 and tiny.dtype is DType.FLOAT32
    assert "small" in PRESETS and PRESETS["small"].hidden_size > tiny.hidden_size


def test_kv_layout() -> None:
    layout = kv_layout(PRESETS["tiny"], block_size=16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == (4, 2, 32, 16)
    assert layout.dtype is DType.FLOAT32
    with pytest.raises(ValueError):
        kv_layout(PRESETS["tiny"], 0)
