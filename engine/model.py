"""A Llama-like decoder over a paged KV cache, numerically matching transformers' models.

`LlamaForCausalLM` runs every family `ModelConfig.architecture` names (Llama, Mistral,
Qwen2, Qwen3): they differ only in attention biases, Qwen3's per-head q/k RMSNorm,
head_dim and RoPE scaling, all read from the config.

One `forward` computes a batch of sequences whose tokens are concatenated along
the token dimension (prompt steps, decode steps and chunked continuations mixed).
Row-wise work (projections, norms, MLP) goes through `engine.ops`, which makes
every row bit-identical whatever else is in the batch; attention is computed one
sequence at a time, so it is batch-invariant by construction. Each token's K and V
are written to the cache first, then every query reads its sequence's K/V back
from the cache, so a prompt step and the decode steps that follow read the same
(possibly down-cast) values.

Parameter names mirror Hugging Face's, so a state dict loads either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvwire.connectors.kv_pool import TORCH_DTYPES
from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.engine.model_config import ModelConfig
from kvwire.engine.ops import batch_invariant_linear, rms_norm, silu_mul
from kvwire.engine.rope import rope_tables


class SeqAttention(NamedTuple):
    """Where one sequence's queries sit in the batch and which cache slots they read."""

    rows: slice  # the sequence's rows in the batch's [num_tokens, ...] tensors
    read_blocks: torch.Tensor  # [kv_len] block id of each position 0 .. end_pos-1
    read_slots: torch.Tensor  # [kv_len] slot within that block
    mask: torch.Tensor | None  # [num_q, kv_len] bool, True = may attend; None = attend to all


class AttentionMetadata(NamedTuple):
    """Computed once per forward and shared by every layer."""

    positions: torch.Tensor  # [num_tokens] absolute position of each token
    write_blocks: torch.Tensor  # [num_tokens] block each token's K/V goes to
    write_slots: torch.Tensor  # [num_tokens] slot within that block
    seqs: list[SeqAttention]


def build_attention_metadata(
    model_input: ModelInput, block_size: int, num_blocks: int, max_positions: int, device: torch.device
) -> AttentionMetadata:
    """Turn block tables into per-token write slots and per-sequence read slots.

    Args:
        model_input: the batch.
        block_size: tokens per KV block.
        num_blocks: blocks in the pool.
        max_positions: positions the model supports.
        device: where the index tensors live.
    Returns:
        The metadata.
    Raises:
        ValueError: a sequence has no tokens, outruns its block table or the model's
            positions, or names a block outside the pool.
    """
    positions, seqs = [], []
    write_blocks, write_slots = [], []
    for seq, rows in zip(model_input.sequences, model_input.token_slices()):
        _check_sequence(seq, block_size, num_blocks, max_positions)
        table = torch.tensor(seq.block_ids, dtype=torch.long, device=device)
        kv_pos = torch.arange(seq.end_pos, device=device)  # [kv_len]
        q_pos = kv_pos[seq.start_pos:]  # [num_q]
        # a lone query is the newest position and sees everything before it
        mask = kv_pos[None, :] <= q_pos[:, None] if seq.num_tokens > 1 else None  # [num_q, kv_len]
        blocks, slots = table[kv_pos // block_size], kv_pos % block_size  # [kv_len] each
        seqs.append(SeqAttention(rows, blocks, slots, mask))
        positions.append(q_pos)
        write_blocks.append(blocks[seq.start_pos:])
        write_slots.append(slots[seq.start_pos:])
    return AttentionMetadata(
        _cat_long(positions, device), _cat_long(write_blocks, device), _cat_long(write_slots, device), seqs)


def _check_sequence(seq: SequenceInput, block_size: int, num_blocks: int, max_positions: int) -> None:
    if seq.num_tokens == 0:
        raise ValueError(f"{seq.request_id}: no tokens to compute")
    if seq.start_pos < 0 or seq.end_pos > max_positions:
        raise ValueError(f"{seq.request_id}: positions {seq.start_pos}..{seq.end_pos} "
                         f"outside 0..{max_positions}")
    used = -(-seq.end_pos // block_size)
    if used > len(seq.block_ids):
        raise ValueError(f"{seq.request_id}: {len(seq.block_ids)} blocks of {block_size} "
                         f"cannot hold {seq.end_pos} tokens")
    bad = [b for b in seq.block_ids[:used] if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{seq.request_id}: blocks {bad[:8]} outside a pool of {num_blocks}")


def _cat_long(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: `[N, heads, head_dim]`; cos, sin: `[N, head_dim]` in x's dtype."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: `[N, in]` -> `[N, out]` through layer's weight and bias (if any)."""
    return batch_invariant_linear(x, layer.weight, layer.bias)


class LlamaAttention(nn.Module):
    """Grouped-query attention over the paged cache (optional biases, optional per-head q/k norm)."""

    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        assert config.head_dim is not None  # filled in by ModelConfig.__post_init__
        self.head_dim = config.head_dim
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=config.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(config.hidden_size, kv_out, bias=config.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(config.hidden_size, kv_out, bias=config.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=config.o_bias, dtype=dtype)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: over head_dim, the same weight for every head
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """x: `[N, hidden]`; cos, sin: `[N, head_dim]`;
        kv_cache: `[num_blocks, 2, block_size, kv_heads, head_dim]`. Returns `[N, hidden]`."""
        n = x.shape[0]
        q = _linear(x, self.q_proj).view(n, self.num_heads, self.head_dim)
        k = _linear(x, self.k_proj).view(n, self.num_kv_heads, self.head_dim)
        v = _linear(x, self.v_proj).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)  # rows: [N * heads, head_dim]
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]  # [blocks, block_size, kv_heads, head_dim]
        k_cache[meta.write_blocks, meta.write_slots] = k.to(k_cache.dtype)
        v_cache[meta.write_blocks, meta.write_slots] = v.to(v_cache.dtype)
        out = torch.empty_like(q)  # [N, heads, head_dim]
        for seq in meta.seqs:
            out[seq.rows] = self._attend(q[seq.rows], k_cache, v_cache, seq)
        return _linear(out.view(n, -1), self.o_proj)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seq: SeqAttention) -> torch.Tensor:
        """One sequence: q `[num_q, heads, head_dim]` -> `[num_q, heads, head_dim]`."""
        rep = self.num_heads // self.num_kv_heads
        k = k_cache[seq.read_blocks, seq.read_slots].to(q.dtype)  # [kv_len, kv_heads, head_dim]
        v = v_cache[seq.read_blocks, seq.read_slots].to(q.dtype)
        k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, kv_len, head_dim]
        v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=seq.mask)
        return out.transpose(0, 1)  # [num_q, heads, head_dim]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[N, hidden]` -> `[N, hidden]`."""
        gate = batch_invariant_linear(x, self.gate_proj.weight)  # [N, intermediate]
        up = batch_invariant_linear(x, self.up_proj.weight)
        return batch_invariant_linear(silu_mul(gate, up), self.down_proj.weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """x: `[N, hidden]` -> `[N, hidden]`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Llama-like decoder + LM head over a paged KV cache (every `Architecture`)."""

    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        dtype = TORCH_DTYPES[config.dtype]
        self.model = LlamaModel(config, dtype)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        assert config.head_dim is not None  # filled in by ModelConfig.__post_init__
        cos, sin = rope_tables(config.head_dim, config.rope_theta, config.rope_scaling,
                               config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, head_dim] float32
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[vocab, hidden]`: the LM head, or the embedding when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(self, model_input: ModelInput, kv_caches: list[torch.Tensor],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute every token of the batch, writing its K/V into the paged cache.

        Args:
            model_input: sequences whose tokens are concatenated; each token at position p
                goes to block `block_ids[p // block_size]`, slot `p % block_size`.
            kv_caches: per layer `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
                (0 = K, 1 = V), e.g. `KVPool.kv_caches`.
            on_layer: called with each layer's index once its K/V writes are issued (layer-wise
                KV streaming; on CUDA the callee records an event to know when they ran).
        Returns:
            Hidden states after the final RMSNorm, `[num_tokens, hidden]`.
        Raises:
            ValueError: wrong number of caches, a token outside the vocabulary, or a
                sequence its block table or the RoPE table cannot hold.
        """
        cfg = self.config
        if len(kv_caches) != cfg.num_hidden_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {cfg.num_hidden_layers} layers")
        device = self.model.embed_tokens.weight.device
        ids = [t for s in model_input.sequences for t in s.token_ids]
        token_ids = torch.tensor(ids, dtype=torch.long, device=device)  # [N]
        if ids and not 0 <= min(ids) <= max(ids) < cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
        num_blocks, _, block_size = kv_caches[0].shape[:3]
        meta = build_attention_metadata(
            model_input, block_size, num_blocks, cfg.max_position_embeddings, device)
        x = F.embedding(token_ids, self.model.embed_tokens.weight)  # [N, hidden]
        cos = self.rope_cos[meta.positions].to(x.dtype)  # [N, head_dim]
        sin = self.rope_sin[meta.positions].to(x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(x, cos, sin, meta, kv_cache)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to the vocabulary.

        Args:
            hidden: `[M, hidden]` from `forward`.
        Returns:
            `[M, vocab]` float32.
        """
        return batch_invariant_linear(hidden, self.lm_head_weight).float()
