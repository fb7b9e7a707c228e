"""Tiny LoRA adapters (PEFT's format, which vLLM's --lora-modules loads) for kvwire's tiny Llama checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
SCALE = 0.3  # each adapter changes the model's greedy text from the base model's and from the other adapters'


def write_tiny_lora(path: Path, model_dir: Path, seed: int) -> Path:
    """A rank-RANK adapter of every layer's q, k and v projections of the checkpoint in `model_dir`, drawn from
    `seed`. Returns: `path`, holding adapter_config.json and adapter_model.safetensors."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    draw = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=draw) * SCALE  # [rank, in]
            weights[f"{name}.lora_B.weight"] = torch.randn(out, RANK, generator=draw) * SCALE  # [out, rank]
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "target_modules": list(outs), "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(model_dir)}))
    return path
