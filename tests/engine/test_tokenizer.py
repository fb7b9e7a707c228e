"""Byte tokenizer and tokenizer.json loading."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, trainers

from kvwire.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ 🚀\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.eos_token_id is None and isinstance(tok, Tokenizer)


def test_byte_decode_drops_specials_and_replaces_invalid_utf8() -> None:
    tok = ByteTokenizer(320)
    assert tok.decode([104, 256, 105, 319]) == "hi"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a truncated 3-byte character


def test_load_without_tokenizer_json_is_bytes(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 320


def test_load_tokenizer_json(tmp_path: Path) -> None:
    impl = HFTok(models.WordLevel(unk_token="[UNK]"))
    impl.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    impl.train_from_iterator(["the cat sat on the mat", "a dog sat too"], trainer)
    impl.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    ids = tok.encode("the dog sat")
    assert len(ids) == 3 and tok.decode(ids) == "the dog sat"
    assert tok.eos_token_id == impl.token_to_id("</s>")
    assert tok.vocab_size == impl.get_vocab_size()
