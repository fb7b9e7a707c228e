"""Text <-> token ids: a checkpoint's tokenizer.json when it ships one, else raw UTF-8 bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizerImpl

NUM_BYTES = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and router need from a tokenizer."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; larger ids (specials of byte-level models) decode to nothing."""

    eos_token_id: int | None = None

    def __init__(self, vocab_size: int = NUM_BYTES):
        if vocab_size < NUM_BYTES:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {NUM_BYTES}, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Args: text (a byte tokenizer adds no specials either way). Returns: its UTF-8 bytes as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Args: ids. Returns: the bytes decoded as UTF-8, invalid sequences as U+FFFD."""
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json; encode adds the special tokens its post-processor
    defines (e.g. Llama's BOS), decode skips special tokens."""

    def __init__(self, impl: HFTokenizerImpl, eos_token_id: int | None):
        self._impl = impl
        self.eos_token_id = eos_token_id
        self.vocab_size = impl.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Args: text; add_special_tokens: False for text that already holds them (a rendered chat template).
        Returns: token ids."""
        return self._impl.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Args: ids. Returns: the text (special tokens skipped)."""
        return self._impl.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The checkpoint's tokenizer.

    Args:
        model_dir: a checkpoint directory.
    Returns:
        `HFTokenizer` from model_dir/tokenizer.json when present, else a `ByteTokenizer`
        sized to config.json's vocab_size (256 without one).
    """
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return ByteTokenizer(max(NUM_BYTES, config.get("vocab_size", NUM_BYTES)))
    impl = HFTokenizerImpl.from_file(str(path))
    return HFTokenizer(impl, _eos_id(impl, model_dir, config))


def _eos_id(impl: HFTokenizerImpl, model_dir: Path, config: dict) -> int | None:
    """tokenizer_config.json's eos_token (by name), else config.json's eos_token_id."""
    eos = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # older files store an AddedToken dict
        eos = eos.get("content")
    if isinstance(eos, str) and impl.token_to_id(eos) is not None:
        return impl.token_to_id(eos)
    eos_id = config.get("eos_token_id")
    if isinstance(eos_id, list):  # HF allows several; the engine stops on the first
        eos_id = eos_id[0] if eos_id else None
    return eos_id


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
