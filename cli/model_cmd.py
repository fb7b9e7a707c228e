"""`kvwire init-model`: write a randomly initialised checkpoint in Hugging Face format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvwire.cli.extras import NODE, require
from kvwire.engine.model_config import PRESETS


def init_model(out_dir: Annotated[Path, typer.Argument(help="Directory to write config.json, model.safetensors "
                                                             "and chat_template.jinja to.")],
               preset: Annotated[str, typer.Option("--preset", help=f"One of: {', '.join(PRESETS)}.")] = "tiny",
               seed: Annotated[int, typer.Option("--seed", help="RNG seed of the weights.")] = 0,
               hf_tokenizer: Annotated[bool, typer.Option(
                   "--hf-tokenizer", help="Also write tokenizer.json and tokenizer_config.json (byte-level, with a "
                                          "chat template), which vLLM and transformers need.")] = False) -> None:
    """Write a random checkpoint (Llama, Mistral, Qwen2 or Qwen3 by preset) that kvwire and transformers both load."""
    require("init-model", NODE)

    from kvwire.engine.byte_tokenizer_files import write_byte_tokenizer, write_chat_template
    from kvwire.engine.init_model import write_random_checkpoint

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}", param_hint="--preset")
    config = write_random_checkpoint(out_dir, preset, seed)
    write_chat_template(out_dir)
    if hf_tokenizer:
        assert config.bos_token_id is not None and config.eos_token_id is not None, "presets name their specials"
        write_byte_tokenizer(out_dir, config.bos_token_id, config.eos_token_id)
    typer.echo(f"wrote {preset} checkpoint ({config.architecture}, {config.num_hidden_layers} layers, "
               f"hidden {config.hidden_size}) to {out_dir}")
