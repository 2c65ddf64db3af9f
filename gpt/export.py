"""Export a training run's checkpoint as a Hugging Face directory, in the format of the first family that holds its
shape (`gpt.model.families`: GPT-2's, Llama's, Mistral's, Qwen's or Gemma's).

    python -m gpt.export --out_dir out --hf_dir exported/
"""

from __future__ import annotations

if __name__ == "__main__":  # as a command line: before the imports (`gpt.process_start`)
    from gpt.process_start import start_command_line

    start_command_line()

import dataclasses

import tyro

from gpt.errors import cli_main
from gpt.model import gpt2, llama
from gpt.model.config import GPTConfig
from gpt.model.families import holding
from gpt.run_tokenizer import hf_files
from gpt.train.checkpoint import load_model


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    out_dir: str = "out"
    """The training run's out_dir."""
    hf_dir: str = "exported"
    """Where to write config.json + model.safetensors (loadable by transformers' AutoModelForCausalLM) and the run's
    tokenizer (by AutoTokenizer): a new or empty directory, or a previous export, which is replaced whole."""
    step: int | None = None
    """The checkpoint step (default: the latest)."""


def main(config: ExportConfig) -> None:
    model = load_model(config.out_dir, config.step)
    tokenizer_files = hf_files(config.out_dir, model.config.block_size)
    print(f"wrote {format_of(model.config).save(model, config.hf_dir, tokenizer_files)}")


def format_of(config: GPTConfig):
    """The module (`gpt2` or `llama`) that writes the first family's format that holds a model of `config`
    (`gpt.model.families.holding`); ConfigError naming what each cannot hold."""
    return gpt2 if holding(config).reader == "gpt2" else llama


if __name__ == "__main__":
    cli_main(lambda: main(tyro.cli(ExportConfig)))()  # a flag's ConfigError as tyro builds it: one line too
