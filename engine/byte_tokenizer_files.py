"""tokenizer.json and tokenizer_config.json for kvwire's byte-level random checkpoints.

vLLM and transformers need a Hugging Face tokenizer; kvwire's random checkpoints speak
bytes (`ByteTokenizer`: UTF-8 byte b is id b, ids 256 and 257 are bos and eos). These files
describe the same mapping as a `tokenizers` byte-level BPE with no merges, so every
engine turns a text into the same ids. No bos is added on encode, as `ByteTokenizer` adds
none. A small chat template lets the model chat: `write_chat_template` writes it as
chat_template.jinja (every `kvwire init-model` checkpoint has one), and tokenizer_config.json
carries it too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def write_chat_template(out_dir: Path) -> Path:
    """Write `CHAT_TEMPLATE` as `out_dir/chat_template.jinja` (where transformers v5 and the router look).

    Returns:
        The file written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CHAT_TEMPLATE_FILE
    path.write_text(CHAT_TEMPLATE)
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(out_dir: Path, bos_id: int, eos_id: int) -> None:
    """Write the two files into `out_dir` (ids 0..255 bytes; `bos_id`, `eos_id` the specials, both >= 256)."""
    assert bos_id >= 256 and eos_id >= 256 and bos_id != eos_id, "specials live above the bytes"
    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # the specials' ids are the checkpoint's; added tokens take the next free ids, so fill the gap first
    for i in range(256, max(bos_id, eos_id) + 1):
        name = {bos_id: BOS, eos_id: EOS}.get(i, f"<unused{i}>")
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
    assert tok.token_to_id(BOS) == bos_id and tok.token_to_id(EOS) == eos_id
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20,
              "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
