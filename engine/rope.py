"""Rotary position embeddings: the default RoPE and the scaled variants real checkpoints use.

`inv_freq` computes the same inverse frequencies as transformers' `ROPE_INIT_FUNCTIONS` for the
types rope_scaling.py accepts.
"""

from __future__ import annotations

import math

import torch

from kvwire.engine.rope_scaling import RopeScaling, RopeType


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The inverse frequency of each rotated pair, as transformers computes it.

    Args:
        head_dim: per-head width (even).
        theta: the RoPE base.
        scaling: None for default RoPE.
    Returns:
        `[head_dim / 2]` float32.
    """
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [head_dim/2]
    if scaling is None:
        return freq
    if scaling.rope_type is RopeType.LINEAR:
        return freq / scaling.factor
    return _llama3_inv_freq(freq, scaling)


def _llama3_inv_freq(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`, step for step. freq: `[head_dim / 2]`."""
    assert s.original_max_position_embeddings is not None  # checked in RopeScaling.__post_init__
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    old_len = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / s.factor, freq)  # low frequencies: divided
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(head_dim: int, theta: float, scaling: RopeScaling | None,
                max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, computed once (rotate_half layout, like transformers).

    Returns:
        (cos, sin), each `[max_positions, head_dim]` float32.
    """
    freq = inv_freq(head_dim, theta, scaling)  # [head_dim/2]
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * freq[None, :]  # [max_pos, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
    return emb.cos(), emb.sin()
