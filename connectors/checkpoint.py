"""A checkpoint's safetensors files, and its fingerprint: which model's KV a pool holds.

Two checkpoints of one architecture and size (a base model and its fine-tune, two seeds of a random
one, Llama and Qwen2 at the same dimensions) have the same KV layout, and a decode node that bypassed
its prompt with the other's KV would answer wrongly without a sign. The fingerprint (`KVLayout.model`)
covers config.json (its keys sorted, without those that name the file rather than the model) and every
tensor's name, dtype and shape, with three samples of its bytes (start, middle, end): a few hundred
bytes read per tensor, so it takes milliseconds where hashing the weights whole would take seconds of
a GPU node's start-up. It does not depend on the directory's path or on how the tensors are split into
shards. A changed tensor whose sampled bytes all stay the same goes unnoticed: it guards against the
wrong checkpoint, it is not a checksum.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO

INDEX_FILE = "model.safetensors.index.json"
SAMPLE_BYTES = 256
FINGERPRINT_CHARS = 16  # hex digits kept: 64 bits
_VOLATILE_KEYS = ("_name_or_path", "transformers_version")  # where and by what it was saved, not what it is


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every `*.safetensors`.

    Raises:
        FileNotFoundError: no safetensors file (pickle checkpoints are not read).
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are absent: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir} (pickle formats such as *.bin are not loaded)")
    return files


def model_fingerprint(model_dir: Path) -> str:
    """The fingerprint of the checkpoint in `model_dir` (config.json and its safetensors files).

    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ValueError: a file that is not safetensors, a config.json that is not JSON.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in _VOLATILE_KEYS:
        config.pop(key, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for path in checkpoint_files(model_dir):
        tensors.update(_sampled(path))
    for name in sorted(tensors):
        dtype, shape, samples = tensors[name]
        digest.update(json.dumps([name, dtype, shape]).encode())
        digest.update(samples)
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def name_fingerprint(name: str, revision: str | None) -> str:
    """A checkpoint known only by its name (and revision), as vLLM's NIXL connector tells models apart."""
    return hashlib.sha256(json.dumps([name, revision]).encode()).hexdigest()[:FINGERPRINT_CHARS]


def _sampled(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """{tensor name: (dtype, shape, its sampled bytes)} of one safetensors file."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a safetensors file ({exc})") from None
        base = 8 + header_len
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            out[name] = (entry["dtype"], entry["shape"], _samples(f, base + start, base + end))
        return out


def _samples(f: BinaryIO, start: int, end: int) -> bytes:
    """Up to SAMPLE_BYTES from the start, the middle and the end of the range [start, end) of `f`."""
    size = end - start
    if size <= 3 * SAMPLE_BYTES:
        f.seek(start)
        return f.read(size)
    parts = []
    for at in (start, start + (size - SAMPLE_BYTES) // 2, end - SAMPLE_BYTES):
        f.seek(at)
        parts.append(f.read(SAMPLE_BYTES))
    return b"".join(parts)
