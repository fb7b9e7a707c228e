"""Loads a Hugging Face-format checkpoint (config.json + safetensors) of a supported family
(Llama, Mistral, Qwen2, Qwen3: `model_config.Architecture`) into `LlamaForCausalLM`.

Only safetensors are read: a checkpoint is data, and pickle-based formats
(`*.bin`, `*.pt`) can run code when loaded, so they are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kvwire.connectors.checkpoint import checkpoint_files
from kvwire.engine.model import LlamaForCausalLM
from kvwire.engine.model_config import ModelConfig, load_config

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older transformers saved; recomputed here


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, on the CPU, by HF name.

    Raises:
        ValueError: one name in two shards.
    """
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name} appears in more than one shard ({path.name})")
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(model_dir: Path, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build the model a checkpoint directory describes and load its weights.

    Args:
        model_dir: holds config.json and model.safetensors (or shards + index).
        device: where the model goes.
    Returns:
        The model in eval mode.
    Raises:
        FileNotFoundError: config.json or the weights are absent.
        ValueError: missing, unexpected or misshapen tensors (named), or an unsupported config.
    """
    config = load_config(model_dir)
    tensors = read_tensors(model_dir)
    model = LlamaForCausalLM(config)
    _drop_redundant(tensors, config)
    params = model.state_dict()
    _check_names_and_shapes(params, tensors)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])  # casts to the config's dtype
    return model.to(device).eval()


def _drop_redundant(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Remove tensors that carry no information for this model (in place).

    Raises:
        ValueError: a tied checkpoint ships an lm_head that differs from its embedding.
    """
    for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
        del tensors[name]
    head = tensors.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None:
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(head, embed):
            raise ValueError("tie_word_embeddings is set but lm_head.weight differs from "
                             "model.embed_tokens.weight")
        del tensors["lm_head.weight"]


def _check_names_and_shapes(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    wrong = [f"{n}: checkpoint {tuple(tensors[n].shape)} != model {tuple(params[n].shape)}"
             for n in sorted(set(params) & set(tensors)) if tensors[n].shape != params[n].shape]
    problems = []
    if missing:
        problems.append(f"missing keys {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_preview(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes {_preview(wrong)}")
    if problems:
        raise ValueError("checkpoint does not match the config: " + "; ".join(problems))


def _preview(items: list[str], limit: int = 8) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
