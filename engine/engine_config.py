"""How a process's engine is sized: the checkpoint, the KV pool, the device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """Attributes:
    model_dir: Hugging Face-format checkpoint directory.
    block_size: tokens per KV block.
    num_blocks: KV blocks in the pool (allocated once at start).
    max_model_len: longest prompt + completion accepted; 0 means the model's limit.
    device: torch device of the model and pool.
    torch_threads: intra-op threads; 0 keeps torch's default. Nodes sharing a host's cores
        must not oversubscribe them: OpenMP threads spinning in barriers while the other
        process runs made a 2-core demo many times slower, so nodes default to 1.
    prefix_cache: keep computed blocks to start later prompts on their longest cached prefix (a decode node's
        engine; a prefill node's prompts, each published whole).
    """

    model_dir: Path
    block_size: int = 16
    num_blocks: int = 512
    max_model_len: int = 0
    device: str = "cpu"
    torch_threads: int = 1
    prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
