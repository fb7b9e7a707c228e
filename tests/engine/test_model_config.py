"""ModelConfig: HF round trip, validation, presets, KV layout."""

from __future__ import annotations

import pytest

from kvwire.connectors.wire import DType
from kvwire.engine.model_config import PRESETS, ModelConfig, kv_layout


def test_hf_dict_round_trip() -> None:
    for config in PRESETS.values():
        d = config.to_hf_dict()
        assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
        assert d["torch_dtype"] == "float32" and d["hidden_act"] == "silu"
        assert d["attention_bias"] is False and d["mlp_bias"] is False
        assert ModelConfig.from_hf_dict(d) == config


def test_from_hf_dict_defaults_and_legacy_keys() -> None:
    d = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": [7, 8]}
    config = ModelConfig.from_hf_dict(d)
    assert config.head_dim == 32 and config.num_key_value_heads == 8
    assert config.rope_theta == 500000.0 and config.dtype is DType.BFLOAT16
    assert config.eos_token_id == 7


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope scaling"),
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
